"""The deployment's cluster secret on the internal gRPC plane (docs/architecture.md#security).

Imported by every process that speaks the internal plane -- router, workers, controller -- so
the secret is read, sent and checked in one way everywhere:

- ``tandem serve`` makes one secret per deployment (``new_secret``) and hands it to the router
  and the workers in the environment: ``TANDEM_CLUSTER_SECRET``, or ``TANDEM_CLUSTER_SECRET_FILE``
  naming a 0600 file. Never on a command line, never in a log line.
- A client sends it as metadata ``x-tandem-cluster-secret`` on every call (``SecretStub``).
- A server guards the services it names with ``SecretInterceptor``: no secret is
  UNAUTHENTICATED (the router's admin service: PERMISSION_DENIED), a wrong one
  PERMISSION_DENIED, compared in constant time. Health and
  reflection stay open, as load balancers and grpcurl expect.
"""
from __future__ import annotations

import functools
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

SECRET_ENV = "TANDEM_CLUSTER_SECRET"
SECRET_FILE_ENV = "TANDEM_CLUSTER_SECRET_FILE"
METADATA_KEY = "x-tandem-cluster-secret"
MIN_SECRET_CHARS = 16


def new_secret() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def load_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """The secret from ``TANDEM_CLUSTER_SECRET_FILE`` (checked to be private) or
    ``TANDEM_CLUSTER_SECRET``; None when neither is set. Raises ValueError on a bad one."""
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV, "")
    if path:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise ValueError(f"{SECRET_FILE_ENV}={path} is readable by others (mode {mode & 0o777:o}): "
                             f"chmod 600 {path}")
        secret = Path(path).read_text(encoding="utf-8").strip()
    else:
        secret = env.get(SECRET_ENV, "").strip()
    if not secret:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret is {len(secret)} characters; use at least {MIN_SECRET_CHARS} "
                         f"(python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return secret


def require_secret(who: str, environ: Mapping[str, str] | None = None) -> str:
    """``load_secret``, or a ValueError that says how to give one."""
    secret = load_secret(environ)
    if secret is None:
        raise ValueError(f"{who} needs the deployment's cluster secret: set {SECRET_ENV}, or {SECRET_FILE_ENV} "
                         f"to a file of mode 0600 holding it (`tandem serve` does this for what it starts)")
    return secret


def write_secret_file(path: str | os.PathLike, secret: str) -> Path:
    """Write ``secret`` to a new file created 0600 (never world-readable, not even briefly)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return path


def metadata(secret: str) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, secret),)


class SecretStub:
    """A generated stub whose every method sends the cluster secret (no client interceptor,
    so the hot path pays nothing but one more header)."""

    def __init__(self, stub: Any, secret: str) -> None:
        for name, method in vars(stub).items():
            setattr(self, name, functools.partial(method, metadata=metadata(secret)))

    def __getattr__(self, name: str) -> Any:
        """Only for names ``__init__`` did not set (the type checker's view of the stub's methods)."""
        raise AttributeError(f"{type(self).__name__} has no method {name!r}")


def check(invocation_metadata: Iterable[tuple[str, Any]] | None, secret: str | None,
          missing: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> tuple[grpc.StatusCode, str] | None:
    """None when the metadata carries ``secret``; else the status and message to refuse with
    (``missing`` when it carries none)."""
    given = next((v for k, v in (invocation_metadata or ()) if k == METADATA_KEY), None)
    if given is None:
        return missing, f"missing cluster secret (metadata {METADATA_KEY})"
    if secret is None:
        return grpc.StatusCode.PERMISSION_DENIED, "this server has no cluster secret: internal calls are refused"
    given = given.encode() if isinstance(given, str) else bytes(given)
    if not hmac.compare_digest(given, secret.encode()):
        return grpc.StatusCode.PERMISSION_DENIED, "wrong cluster secret"
    return None


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``services`` (full names) that do not carry the cluster secret: a wrong
    one with PERMISSION_DENIED, none with ``missing`` (the router's admin service says
    PERMISSION_DENIED to anonymous and tenant callers alike). ``secret=None`` refuses them all."""

    def __init__(self, secret: str | None, services: Iterable[str],
                 missing: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> None:
        self._secret = secret
        self._prefixes = tuple(f"/{name}/" for name in services)
        self._missing = missing

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefixes):
            return handler
        refusal = check(details.invocation_metadata, self._secret, self._missing)
        return handler if refusal is None else _refusing(handler, *refusal)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""
    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class SecretClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """For a sync channel (``grpc.intercept_channel``) whose every call must carry the secret:
    test harnesses and tools that reach the stub's methods in more ways than a plain call."""

    def __init__(self, secret: str) -> None:
        self._metadata = metadata(secret)

    def _with_secret(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_secret(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_secret(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_secret(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_secret(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
