"""Entry point: ``python -m router --model NAME --prefill ADDR --decode ADDR ...`` (see ``--help``).

Prints ``TANDEM_ROUTER_READY {"http": "host:port", "grpc": "host:port"}`` when both servers
listen, then serves until SIGINT/SIGTERM. Needs the deployment's cluster secret in the
environment (TANDEM_CLUSTER_SECRET or TANDEM_CLUSTER_SECRET_FILE, see protos/auth.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from protos.grpc_io import use_polling_io
from protos.process import freeze_heap

use_polling_io()   # before anything imports grpc (protos/grpc_io.py): the router's process, not its package

from engine.config import LOAD_FORMATS  # noqa: E402
from router.config import DECODE_POLICIES, PREFILL_POLICIES, READY_PREFIX, RouterConfig, add_public_api_args  # noqa: E402
from router.server import Router  # noqa: E402


def parse_args(argv: list[str] | None) -> RouterConfig:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="python -m router", description="Tandem router: gRPC + OpenAI HTTP API")
    p.add_argument("--model", default=d.model, help="model the workers serve (built-in name, HF dir or .gguf)")
    p.add_argument("--served-model-name", default="", help="name clients use (default: --model)")
    p.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS,
                   help="the workers' --load-format: with dummy (random weights) a worker is checked against "
                        "--model's config alone, never its weight files")
    p.add_argument("--host", default=d.host)
    p.add_argument("--http-port", type=int, default=d.http_port, help="0 = pick a free port, -1 = no HTTP")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="0 = pick a free port")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR", help="prefill worker (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR", help="decode worker (repeatable)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY", ""), help="or TANDEM_API_KEY")
    p.add_argument("--prefill-policy", default=d.prefill_policy, choices=PREFILL_POLICIES)
    p.add_argument("--decode-policy", default=d.decode_policy, choices=DECODE_POLICIES)
    add_public_api_args(p)
    p.add_argument("--local-prefill-max-tokens", type=int, default=d.local_prefill_max_tokens,
                   help="conditional disaggregation: a prompt of at most this many tokens is prefilled by its decode "
                        "worker itself, with no prefill worker or KV transfer (0 = always a prefill worker)")
    p.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s)
    p.add_argument("--heartbeat-timeout-s", type=float, default=d.heartbeat_timeout_s)
    p.add_argument("--max-missed-heartbeats", type=int, default=d.max_missed_heartbeats)
    p.add_argument("--max-attempts", type=int, default=d.max_attempts)
    p.add_argument("--failover-wait-s", type=float, default=d.failover_wait_s,
                   help="how long a failing-over request waits for a healthy worker of each role")
    p.add_argument("--drain-move-after-s", type=float, default=d.drain_move_after_s, metavar="S",
                   help="a draining decode worker's streams still running S seconds after the drain began resume "
                        "on other pairs (their prompt and output prefilled again), so a scale-down ends then; "
                        "default: they finish where they run")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s router %(name)s: %(message)s", stream=sys.stderr)
    return RouterConfig(model=args.model, served_model_name=args.served_model_name, load_format=args.load_format,
                        host=args.host,
                        http_port=args.http_port, grpc_port=args.grpc_port, prefill=tuple(args.prefill),
                        decode=tuple(args.decode), api_key=args.api_key, prefill_policy=args.prefill_policy,
                        decode_policy=args.decode_policy, max_waiting=args.max_waiting,
                        max_predicted_wait_s=args.max_predicted_wait_s, max_tpot_s=args.max_tpot_s,
                        max_sub_requests=args.max_sub_requests, max_prompt_chars=args.max_prompt_chars,
                        max_request_body_bytes=args.max_request_body_bytes,
                        grpc_max_concurrent_rpcs=args.grpc_max_concurrent_rpcs,
                        grpc_max_concurrent_streams=args.grpc_max_concurrent_streams,
                        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
                        heartbeat_interval_s=args.heartbeat_interval_s, heartbeat_timeout_s=args.heartbeat_timeout_s,
                        max_missed_heartbeats=args.max_missed_heartbeats, max_attempts=args.max_attempts,
                        failover_wait_s=args.failover_wait_s, drain_move_after_s=args.drain_move_after_s,
                        local_prefill_max_tokens=args.local_prefill_max_tokens, tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        http_header_timeout_s=args.http_header_timeout_s, http_body_timeout_s=args.http_body_timeout_s,
                        http_min_body_rate=args.http_min_body_rate,
                        http_keep_alive_timeout_s=args.http_keep_alive_timeout_s,
                        http_max_connections=args.http_max_connections,
                        metrics_without_api_key=args.metrics_without_api_key)


async def serve(config: RouterConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        router = Router(config)
    except (ValueError, OSError) as exc:   # no or a bad cluster secret; a model whose files are missing
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    try:
        await router.start()
    except OSError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        await router.stop()
        return 2
    freeze_heap()
    print(READY_PREFIX + json.dumps({"http": router.http_address or None, "grpc": router.grpc_address}), flush=True)
    await stop.wait()
    logging.getLogger(__name__).info("router shutting down")
    await router.stop()
    return 0


def run(coro) -> int:
    """On uvloop where it is installed: the loop's own cost per gRPC completion and per HTTP
    chunk is a large part of what the router spends per token (benchmarks/router_overhead.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ValueError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    return run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
