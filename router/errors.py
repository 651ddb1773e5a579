"""Errors a request can end with, and their HTTP status, OpenAI error type and gRPC code (router process).

An error message quotes client input only through ``clip`` (and a worker's words through
``from_worker``), so a 4 MB model name is not 4 MB of gRPC trailers or of a log line, and a
control character reaches neither raw.
"""
from __future__ import annotations

import math
import re

import grpc

CLIP_CHARS = 64          # of client input quoted in a message
WORKER_DETAIL_CHARS = 1024   # of a worker's error text passed on to the client
# IP literals (with their port) in a worker's error text: which hosts serve is not the tenant's business.
_IP_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\[[0-9A-Fa-f:.]+\](?::\d+)?")


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` fit to quote in an error message or a log line: at most ``limit`` of its
    characters, then a marker with how many were left out; a character that is not printable
    (control and format characters, lone surrogates, line separators) written as its escape."""
    head = text[:limit]
    if not head.isprintable():
        head = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in head)
    if len(text) > limit:
        head += f"...<{len(text) - limit} more characters>"
    return head


def without_addresses(text: str, addresses: tuple[str, ...] | list[str] = ()) -> str:
    """``text`` with ``addresses`` and any IP literal written as ``<worker>``."""
    for address in addresses:
        if address:
            text = text.replace(address, "<worker>")
    return _IP_ADDRESS.sub("<worker>", text)


class RouterError(Exception):
    """A request failed in a way the client should hear about, in either API's terms."""

    def __init__(self, http_status: int, grpc_code: grpc.StatusCode, message: str, error_type: str,
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.grpc_code = grpc_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, grpc.StatusCode.INVALID_ARGUMENT, message, "invalid_request_error", param)


def unauthorized() -> RouterError:
    return RouterError(401, grpc.StatusCode.UNAUTHENTICATED, "invalid API key: pass it as 'Authorization: Bearer KEY'",
                       "authentication_error", code="invalid_api_key")


def model_not_found(model: str, served: str) -> RouterError:
    return RouterError(404, grpc.StatusCode.NOT_FOUND, f"the model '{clip(model)}' does not exist; this router serves "
                       f"'{served}'", "invalid_request_error", "model", "model_not_found")


def overloaded(num_waiting: int, max_waiting: int, num_new: int = 1) -> RouterError:
    return RouterError(429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"too many requests waiting ({num_waiting} waiting + {num_new} new > "
                       f"max_waiting={max_waiting}); "
                       "retry later", "rate_limit_error", code="queue_full", retry_after_s=1)


def wait_too_long(wait_s: float, max_wait_s: float, num_waiting_tokens: int, num_new_tokens: int) -> RouterError:
    return RouterError(429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the first token would come in about {wait_s:.1f} s ({num_waiting_tokens} prompt tokens "
                       f"waiting + {num_new_tokens} new, at what the queue has cost to drain), more than "
                       f"max_predicted_wait_s={max_wait_s:g}; retry later", "rate_limit_error", code="queue_full",
                       retry_after_s=max(1, math.ceil(wait_s - max_wait_s)))


def decode_too_slow(pace_s: float, max_tpot_s: float) -> RouterError:
    return RouterError(429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the running streams take {pace_s * 1000:.0f} ms per output token, more than max_tpot_s="
                       f"{max_tpot_s:g}; retry later", "rate_limit_error", code="queue_full", retry_after_s=1)


def body_too_large(max_bytes: int) -> RouterError:
    return RouterError(413, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the request body is larger than max_request_body_bytes={max_bytes}", "invalid_request_error",
                       code="request_too_large")


def host_not_allowed(host: str) -> RouterError:
    return RouterError(400, grpc.StatusCode.PERMISSION_DENIED, f"the Host header '{clip(host)}' is not allowed on this "
                       "server (--allowed-hosts)", "invalid_request_error", code="host_not_allowed")


def unavailable(message: str) -> RouterError:
    """No worker can take the request now (a restart in progress): HTTP says when to retry."""
    return RouterError(503, grpc.StatusCode.UNAVAILABLE, message, "service_unavailable", code="no_worker",
                       retry_after_s=1)


def internal(message: str) -> RouterError:
    return RouterError(500, grpc.StatusCode.INTERNAL, message, "internal_error")


_FROM_GRPC = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
              grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
              grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
              grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
              grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable")}


def from_worker(code: grpc.StatusCode, details: str) -> RouterError:
    """A worker's refusal, passed on to the client: clipped, and with no IP address in it."""
    status, error_type = _FROM_GRPC.get(code, (500, "internal_error"))
    return RouterError(status, code if status != 500 else grpc.StatusCode.INTERNAL,
                       f"worker: {without_addresses(clip(details, WORKER_DETAIL_CHARS))}", error_type)
