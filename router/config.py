"""Router settings (runs in the router process).

``python -m router``'s flags (router/__main__.py, and ``add_public_api_args`` below, which
``tandem serve`` shares) are written out by hand and map onto the fields one to one, except
``rpc_timeout_s``, which has no flag.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

PREFILL_POLICIES = ("cache_aware", "least_load", "power_of_two", "round_robin")
DECODE_POLICIES = ("least_load", "power_of_two", "round_robin")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")   # router/tool_formats.py
READY_PREFIX = "TANDEM_ROUTER_READY "      # `python -m router` prints it + {"http", "grpc"} once listening


@dataclass(frozen=True)
class RouterConfig:
    model: str = "smollm2-135m-instruct"   # tokenizer + served model name (built-in, HF dir or .gguf)
    served_model_name: str = ""            # name clients use; empty = --model
    load_format: str = "auto"              # the workers' --load-format: dummy = they run random weights
    host: str = "127.0.0.1"                # address the HTTP and gRPC servers bind
    http_port: int = 8000                  # 0 picks a free port; -1 disables HTTP
    grpc_port: int = 50051                 # 0 picks a free port
    prefill: tuple[str, ...] = field(default_factory=tuple)   # prefill worker addresses
    decode: tuple[str, ...] = field(default_factory=tuple)    # decode worker addresses
    api_key: str = field(default="", repr=False)  # required Bearer token / metadata; empty = none; never printed
    prefill_policy: str = "cache_aware"
    decode_policy: str = "least_load"
    max_waiting: int = 1024                # sub-requests (prompts x n) waiting for their first token before 429
    max_predicted_wait_s: float = 0.0      # 429 when a request's predicted wait for its first token is longer
    #                                        (router/admission.py; 0 = no such limit)
    max_tpot_s: float = 0.0                # 429 while the running streams' recent time per output token is
    #                                        longer (router/admission.py; 0 = no such limit)
    max_sub_requests: int = 128            # prompts x n in one request; more is a 400
    max_prompt_chars: int = 4 << 20        # characters of a text prompt, or of all chat messages together
    max_request_body_bytes: int = 16 << 20  # HTTP request body, checked before parsing (413); also the
    #                                        largest message the public gRPC port takes (RESOURCE_EXHAUSTED)
    grpc_max_concurrent_rpcs: int = 4096   # gRPC calls in progress at once (Multiplex: one per stream); more
    #                                        are refused with RESOURCE_EXHAUSTED, not queued
    grpc_max_concurrent_streams: int = 1024   # HTTP/2 streams one gRPC connection may have open
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)   # HTTP Host header allow-list against
    #                                        DNS rebinding (host or host:port; empty = any host)
    heartbeat_interval_s: float = 1.0      # Stats poll period per worker
    heartbeat_timeout_s: float = 2.0       # a Stats poll longer than this is late (logged, never a death)
    max_missed_heartbeats: int = 2         # polls in a row finding it gone (UNAVAILABLE) that remove it
    max_attempts: int = 4                  # dispatches per request, the first one included
    rpc_timeout_s: float = 30.0            # a Submit's answer on P's session; DecodeWorker.SetPrefill
    failover_wait_s: float = 60.0          # a failing-over request waits this long for a worker of each
    #                                        role to be healthy again (the controller restarting one)
    drain_move_after_s: float | None = None   # a draining decode worker's streams still running this long
    #                                        after the drain began resume on other pairs (None = they finish there)
    local_prefill_max_tokens: int = 0      # conditional disaggregation: prompts of at most this many tokens
    #                                        are prefilled by their decode worker, no prefill worker (0 = never)
    tool_call_parser: str = ""             # how the model writes tool calls (TOOL_CALL_PARSERS); "" = read
    #                                        from the chat template (router/tool_formats.py)
    enable_auto_tool_choice: bool = True   # tool_choice "auto" (parse calls out of free output) when a
    #                                        parser is known
    # HTTP connections (router/http_server.py): limits no real client reaches, so that no peer
    # holds a connection or a worker slot by sending slowly or not at all
    http_header_timeout_s: float = 20.0    # a request head must arrive whole within this (else 408, closed)
    http_body_timeout_s: float = 30.0      # a request body is checked every this many seconds: 408 if
    http_min_body_rate: int = 1024         # ... fewer than this many bytes/s came in (0: only a full stall)
    http_keep_alive_timeout_s: float = 5.0  # an idle connection between requests is closed after this
    http_max_connections: int = 4096       # open connections (or requests in progress) beyond this get 503
    metrics_without_api_key: bool = False  # serve /metrics without the API key (it is Bearer-guarded with one)

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not (-1 if name == "http_port" else 0) <= port < 65536:
                raise ValueError(f"{name} must be a port in [0, 65535], got {port}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy={self.prefill_policy!r}: use one of {PREFILL_POLICIES}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode_policy={self.decode_policy!r}: use one of {DECODE_POLICIES}")
        for name in ("max_waiting", "max_sub_requests", "max_prompt_chars", "max_request_body_bytes",
                     "grpc_max_concurrent_rpcs", "grpc_max_concurrent_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.heartbeat_timeout_s > 0 and self.heartbeat_interval_s > 0):
            raise ValueError("heartbeat_interval_s and heartbeat_timeout_s must be > 0")
        if self.max_missed_heartbeats < 1:
            raise ValueError(f"max_missed_heartbeats must be >= 1, got {self.max_missed_heartbeats}")
        for name in ("max_predicted_wait_s", "max_tpot_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds (0: no limit), got {getattr(self, name)}")
        if self.failover_wait_s < 0:
            raise ValueError(f"failover_wait_s must be >= 0, got {self.failover_wait_s}")
        if self.drain_move_after_s is not None and not self.drain_move_after_s >= 0:
            raise ValueError(f"drain_move_after_s must be >= 0 (or unset: streams finish where they run), "
                             f"got {self.drain_move_after_s}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r}: use one of {TOOL_CALL_PARSERS}")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.http_min_body_rate < 0:
            raise ValueError(f"http_min_body_rate must be >= 0 bytes/s, got {self.http_min_body_rate}")
        if self.http_max_connections < 1:
            raise ValueError(f"http_max_connections must be >= 1, got {self.http_max_connections}")
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        object.__setattr__(self, "allowed_hosts", tuple(h.lower() for h in self.allowed_hosts))

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def add_public_api_args(p: argparse.ArgumentParser) -> None:
    """The flags that shape what the public API accepts: request limits and tool calling. One
    definition for `python -m router` and `tandem serve`, which forwards them (``public_api_flags``)."""
    d = RouterConfig()
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="sub-requests (prompts x n) waiting for their first token before 429")
    p.add_argument("--max-predicted-wait-s", type=float, default=d.max_predicted_wait_s, metavar="S",
                   help="429 for a request whose first token would come later than S seconds: the requests and "
                        "prompt tokens waiting for a first token plus its own, at what that queue has cost to "
                        "drain while busy (per request and per token) "
                        "(set it to your TTFT objective; 0 = no limit, only --max-waiting)")
    p.add_argument("--max-tpot-s", type=float, default=d.max_tpot_s, metavar="S",
                   help="429 while the running streams' recent time per output token is longer than S seconds "
                        "(set it a little under your TPOT objective; 0 = no limit)")
    p.add_argument("--max-sub-requests", type=int, default=d.max_sub_requests,
                   help="most prompts x n in one request (more is a 400)")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="most characters in a text prompt or in all chat messages together")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="largest HTTP request body (413 beyond it, before parsing) and largest gRPC message "
                        "(RESOURCE_EXHAUSTED)")
    p.add_argument("--grpc-max-concurrent-rpcs", type=int, default=d.grpc_max_concurrent_rpcs,
                   help="gRPC calls in progress at once (a Multiplex stream is one); more are refused with "
                        "RESOURCE_EXHAUSTED")
    p.add_argument("--grpc-max-concurrent-streams", type=int, default=d.grpc_max_concurrent_streams,
                   help="HTTP/2 streams one gRPC connection may have open at once")
    p.add_argument("--allowed-hosts", default="", metavar="HOST[,HOST...]",
                   help="HTTP Host headers to answer (host or host:port; defends against DNS rebinding "
                        "when no API key is set); empty = any")
    p.add_argument("--http-header-timeout-s", type=float, default=d.http_header_timeout_s,
                   help="seconds a request head may take to arrive (slower: 408 and the connection closed)")
    p.add_argument("--http-body-timeout-s", type=float, default=d.http_body_timeout_s,
                   help="a request body is checked every this many seconds: 408 and closed if it sent fewer "
                        "than --http-min-body-rate bytes/s meanwhile")
    p.add_argument("--http-min-body-rate", type=int, default=d.http_min_body_rate,
                   help="bytes/s a request body must keep up (0 = only a body that stops is refused)")
    p.add_argument("--http-keep-alive-timeout-s", type=float, default=d.http_keep_alive_timeout_s,
                   help="idle seconds before a keep-alive HTTP connection is closed")
    p.add_argument("--http-max-connections", type=int, default=d.http_max_connections,
                   help="open HTTP connections (or requests in progress) beyond which requests get 503")
    p.add_argument("--metrics-without-api-key", action="store_true",
                   help="serve the router's /metrics without the API key (with --api-key it wants the key)")
    p.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=("",) + TOOL_CALL_PARSERS,
                   help="how the model writes tool calls: hermes (<tool_call> JSON: Qwen 2.5/3, Hermes, SmolLM2), "
                        "llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), pythonic ([f(a=1)]: Llama 3.2/4 "
                        "pythonic, ToolACE) or qwen3_coder (<function=...> XML); default: picked from the chat "
                        "template's markers (hermes for a template that renders no tools)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                   default=d.enable_auto_tool_choice,
                   help='tool_choice "auto" (the OpenAI default when tools are given): read tool calls out of '
                        "the output with the parser; on by default, --no-enable-auto-tool-choice refuses it")


def public_api_flags(args: argparse.Namespace) -> list[str]:
    """``add_public_api_args``'s flags whose values differ from the defaults, as arguments again."""
    probe = argparse.ArgumentParser()
    add_public_api_args(probe)
    flags: list[str] = []
    for action in probe._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(value, bool):   # store_true, or --X / --no-X
            flags.append(action.option_strings[0 if value else 1])
        else:
            flags += [action.option_strings[0], str(value)]
    return flags
