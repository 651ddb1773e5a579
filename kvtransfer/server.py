"""ZeroMQ transport of a receiver: one ROUTER socket served by one stoppable thread.

Runs in the receiver's process. The ROUTER binds to an explicit host on a random port; every
multipart message goes to ``ReceiverCore.handle``. Other threads hand outgoing messages over a
queue and wake the loop through an inproc PAIR; the same PAIR carries the stop signal. The loop
also expires leases, so a silent sender's request fails on time without any caller polling.
CurveZMQ (on in the workers, keys from the cluster secret: ``CurveKeys.from_secret``): the
socket is a CURVE server, and with an allow-list a ZAP handler thread admits only known client
keys.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import zmq
import zmq.utils.z85

from .messages import MAX_HEADER_BYTES, Message, encode, max_frame_nbytes
from .receiver import ReceiverCore

logger = logging.getLogger(__name__)

POLL_MS = 50            # lease-expiry granularity; the loop sleeps in poll, never spins
RCVHWM = 16            # messages (each ~4 MiB from a Tandem sender, see tcp.MESSAGE_NBYTES) per sender
MAX_BATCH = 64          # messages handled per wake-up before checking for stop/outbox


CURVE_KEY_CONTEXT = b"tandem kvtransfer curve key v1"


@dataclass(frozen=True)
class CurveKeys:
    """A CurveZMQ keypair, Z85-encoded (``zmq.curve_keypair()``)."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_secret(cls, cluster_secret: str) -> CurveKeys:
        """The deployment's keypair, derived from its cluster secret: every receiver serves with
        it and admits only it, every sender connects with it. Whoever lacks the secret can
        neither connect to a receiver nor pose as one (a sender checks the receiver's key)."""
        if not cluster_secret:
            raise ValueError("an empty cluster secret derives no CurveZMQ keys")
        # HMAC-SHA256 as a KDF: 32 uniform bytes are a valid Curve25519 secret key as they are.
        raw = hmac.new(cluster_secret.encode(), CURVE_KEY_CONTEXT, hashlib.sha256).digest()
        secret = zmq.utils.z85.encode(raw)
        return cls(zmq.curve_public(secret), secret)


class ZmqServer:
    def __init__(self, core: ReceiverCore, host: str, curve: CurveKeys | None = None,
                 allowed_clients: Sequence[bytes] | None = None) -> None:
        self._core = core
        self._ctx = zmq.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RCVHWM)
        # Largest legal frame (a payload frame, or a header); zmq drops a peer that exceeds it.
        # zmq measures the frame as it is on the wire: 4 KiB leave room for CurveZMQ's box.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(max_frame_nbytes(core.layout.block_nbytes),
                                                  MAX_HEADER_BYTES) + 4096)
        if curve is not None:
            if allowed_clients is not None:
                self._auth = _start_auth(self._ctx, allowed_clients)
            self._sock.curve_secretkey = curve.secret
            self._sock.curve_publickey = curve.public
            self._sock.curve_server = True
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._wake_addr = f"inproc://kvtransfer-wake-{uuid.uuid4().hex}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._outbox: collections.deque[tuple[bytes, Message]] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtransfer-receiver", daemon=True)
        self._thread.start()

    def send(self, peer: bytes, msg: Message) -> None:
        self._outbox.append((peer, msg))
        self._wake()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=10)
        for s in (self._sock, self._wake_rx, self._wake_tx):
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:
                self._wake_tx.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(POLL_MS))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._sock in events:
                self._serve_batch()
            while self._outbox:
                self._send(*self._outbox.popleft())
            self._core.expire()

    def _serve_batch(self) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 1:
                continue
            try:
                replies = self._core.handle(frames[0].bytes, frames[1:])
            except Exception:  # a bug must not take the data plane down with it
                logger.exception("receiver failed to handle a message; continuing")
                self._core.counters["internal_error"] += 1
                continue
            for peer, msg in replies:
                self._send(peer, msg)

    def _send(self, peer: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([peer, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: the lease covers it
            logger.debug("dropped reply to peer=%s: %s", peer.hex(), exc)


def _start_auth(ctx: zmq.Context, allowed_clients: Sequence[bytes]):
    from zmq.auth.thread import ThreadAuthenticator

    allowed = frozenset(allowed_clients)

    class _AllowList:
        def callback(self, domain: str, key: bytes) -> bool:
            return key in allowed

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowList())
    return auth
