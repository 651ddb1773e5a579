"""Typed msgpack messages of the kvtransfer control and header plane (sender and receiver).

Every message is a msgpack array ``[tag, field, ...]`` decoded only into the dataclasses below,
with a size limit on every field; anything else raises :class:`MessageError` with a short reason
code that the receiver counts. KV bytes never travel inside msgpack: a :class:`WritePayload`
header is followed by raw frames, ``2 * len(layers)`` of them in (layer, K, V) order, each
``len(dst_block_ids) * block_nbytes`` long, and never longer than :func:`max_frame_nbytes` (a
sender splits a write's blocks over several messages to keep to it; the receiver's socket drops a
peer that sends a longer frame).

Widths: block ids and layer ids are non-negative int64 on the wire; request ids are ``str``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import msgpack

MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_ID_LEN = 256
MAX_REASON_LEN = 1024
MAX_LAYERS = 1024
MAX_BLOCK_IDS = 1 << 16          # one message names at most 65536 blocks (1M tokens at bs=16)
MAX_HEARTBEAT_IDS = 4096
MAX_TOP_LOGPROBS = 64
INT64_MAX = (1 << 63) - 1
MAX_FRAME_NBYTES = 4 << 20       # KV bytes in one frame; one block is always allowed


def max_frame_nbytes(block_nbytes: int) -> int:
    """The longest payload frame of a layout: ``MAX_FRAME_NBYTES``, or one block if larger."""
    return max(MAX_FRAME_NBYTES, block_nbytes)


class MessageError(ValueError):
    """A message failed to decode or validate; ``reason`` is a counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class NotifyPayload:
    """Small typed metadata the prefill side sends with a request's completion."""

    first_token_id: int
    first_logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()   # (token_id, logprob) pairs
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class WritePayload:
    """tcp: header of a write whose KV bytes follow as raw frames."""

    request_id: str
    layers: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class WriteDone:
    """One-sided backends: the sender already copied these blocks into the receiver's pool."""

    request_id: str
    layers: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Notify:
    request_id: str
    payload: NotifyPayload


@dataclass(frozen=True)
class Cancel:
    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class CancelAck:
    """Sender → receiver: no more writes for this request will land."""

    request_id: str


@dataclass(frozen=True)
class Heartbeat:
    """Sender → receiver: still alive and working on these requests (renews their leases)."""

    request_ids: tuple[str, ...]


Message = Union[WritePayload, WriteDone, Notify, Cancel, CancelAck, Heartbeat]
_TAGS: dict[type, int] = {WritePayload: 1, WriteDone: 2, Notify: 3, Cancel: 4, CancelAck: 5, Heartbeat: 6}


def encode(msg: Message) -> bytes:
    tag = _TAGS[type(msg)]
    body: list[Any]
    if isinstance(msg, (WritePayload, WriteDone)):
        body = [msg.request_id, list(msg.layers), list(msg.dst_block_ids)]
    elif isinstance(msg, Notify):
        p = msg.payload
        first_logprob = None if p.first_logprob is None else float(p.first_logprob)
        body = [msg.request_id, p.first_token_id, first_logprob,
                [[t, float(lp)] for t, lp in p.top_logprobs], p.num_prompt_tokens, p.num_cached_tokens]
    elif isinstance(msg, Cancel):
        body = [msg.request_id, msg.reason]
    elif isinstance(msg, CancelAck):
        body = [msg.request_id]
    else:
        body = [list(msg.request_ids)]
    # Validate on the way out too, so a sender never emits what a receiver would reject.
    data = msgpack.packb([tag, *body], use_bin_type=True)
    decode(data)
    return data


def decode(data: bytes | memoryview) -> Message:
    if len(data) > MAX_HEADER_BYTES:
        raise MessageError("oversize", f"{len(data)} bytes > {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, max_str_len=MAX_REASON_LEN,
            max_bin_len=0, max_array_len=MAX_BLOCK_IDS, max_map_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MessageError("malformed", type(exc).__name__) from None
    if not isinstance(obj, list) or not obj or type(obj[0]) is not int:
        raise MessageError("malformed", "not a [tag, ...] array")
    tag, body = obj[0], obj[1:]
    if tag in (1, 2):
        _arity(body, 3)
        cls = WritePayload if tag == 1 else WriteDone
        return cls(_request_id(body[0]), _ids(body[1], MAX_LAYERS, "layers"),
                   _ids(body[2], MAX_BLOCK_IDS, "dst_block_ids"))
    if tag == 3:
        _arity(body, 6)
        return Notify(_request_id(body[0]), _payload(body[1:]))
    if tag == 4:
        _arity(body, 2)
        return Cancel(_request_id(body[0]), _str(body[1], MAX_REASON_LEN, "reason"))
    if tag == 5:
        _arity(body, 1)
        return CancelAck(_request_id(body[0]))
    if tag == 6:
        _arity(body, 1)
        if not isinstance(body[0], list) or len(body[0]) > MAX_HEARTBEAT_IDS:
            raise MessageError("bad_field", "request_ids")
        return Heartbeat(tuple(_request_id(r) for r in body[0]))
    raise MessageError("unknown_type", f"tag {tag}")


def _arity(body: list, n: int) -> None:
    if len(body) != n:
        raise MessageError("bad_field", f"expected {n} fields, got {len(body)}")


def _str(value: object, max_len: int, name: str) -> str:
    if type(value) is not str or len(value) > max_len:
        raise MessageError("bad_field", name)
    return value


def _request_id(value: object) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_REQUEST_ID_LEN:
        raise MessageError("bad_field", "request_id")
    return value


def _int(value: object, name: str) -> int:
    if type(value) is not int or not 0 <= value <= INT64_MAX:  # bool is not an int here
        raise MessageError("bad_field", name)
    return value


def _float(value: object, name: str) -> float:
    if type(value) is not float or math.isnan(value):
        raise MessageError("bad_field", name)
    return value


def _ids(value: object, max_len: int, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > max_len:
        raise MessageError("bad_field", name)
    if not all(type(v) is int for v in value) or (value and not (
            0 <= min(value) and max(value) <= INT64_MAX)):  # bool is not an int here
        raise MessageError("bad_field", name)
    ids = tuple(value)
    if len(set(ids)) != len(ids):
        raise MessageError("bad_field", f"duplicate {name}")
    return ids


def _payload(f: list) -> NotifyPayload:
    first_logprob = None if f[1] is None else _float(f[1], "first_logprob")
    if not isinstance(f[2], list) or len(f[2]) > MAX_TOP_LOGPROBS:
        raise MessageError("bad_field", "top_logprobs")
    top = []
    for pair in f[2]:
        if not isinstance(pair, list) or len(pair) != 2:
            raise MessageError("bad_field", "top_logprobs")
        top.append((_int(pair[0], "top_logprobs"), _float(pair[1], "top_logprobs")))
    return NotifyPayload(_int(f[0], "first_token_id"), first_logprob, tuple(top),
                         _int(f[3], "num_prompt_tokens"), _int(f[4], "num_cached_tokens"))
