"""`tandem serve` startup checks and the controller's restart policy, without Ray."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from deploy import serve
from deploy.cli import build_parser
from deploy.controller import CRASHLOOP_AFTER, MAX_BACKOFF_S, STABLE_AFTER_S, Replica, record_failure


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *argv], capture_output=True, text=True, timeout=120)


def test_only_changed_engine_knobs_are_passed_to_workers():
    args = parse("--max-num-seqs", "8", "--no-enable-prefix-caching", "--block-size", "16", "--kv-backend", "tcp",
                 "--host", "0.0.0.0", "--dtype", "bfloat16")  # --host is the router's, not a worker flag
    assert serve.worker_flags(args) == ["--dtype", "bfloat16", "--no-enable-prefix-caching", "--max-num-seqs", "8",
                                        "--kv-backend", "tcp"]


def test_tp_sizes():
    assert serve._tp_sizes(parse()) == {"prefill": 1, "decode": 1}
    assert serve._tp_sizes(parse("--tensor-parallel-size", "2")) == {"prefill": 2, "decode": 2}
    with pytest.raises(ValueError, match="not both"):
        serve._tp_sizes(parse("--tp", "2", "--decode-tp", "2"))
    with pytest.raises(ValueError, match="--prefill-tp 1 and --decode-tp 2 differ"):
        serve._tp_sizes(parse("--decode-tp", "2"))


def test_a_tp_size_that_does_not_divide_the_kv_heads_names_the_sizes_that_do():
    # SmolLM2-135M: 9 attention heads, 3 KV heads.
    with pytest.raises(ValueError, match=r"TP size 2 does not divide the model's 3 KV heads and 9 attention "
                                         r"heads: use --tensor-parallel-size 1 or 3"):
        serve.check_model(parse("--tp", "2"), {"prefill": 2, "decode": 2})


def test_a_taken_port_is_refused_with_the_flag_to_change():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=rf"port {port} on 127.0.0.1 is taken .* pick another with --grpc-port"):
            serve.check_ports("127.0.0.1", {"--http-port": 0, "--grpc-port": port})


def test_a_kv_pool_smaller_than_one_sequence_is_refused_with_numbers():
    args = parse("--kv-cache-memory", str(1 << 20))       # 1 MiB: 46 tokens of SmolLM2 in float32
    arch, _ = serve.check_model(args, {"prefill": 1, "decode": 1})
    with pytest.raises(ValueError, match=r"the KV pool holds \d+ tokens .* less than one max_model_len=8192 sequence: "
                                         r"lower --max-model-len or raise --kv-cache-memory to at least"):
        serve.check_cpu_memory(arch, args, {"prefill": 1, "decode": 1}, 2)


def test_weights_that_do_not_fit_this_machine_are_refused(monkeypatch):
    args = parse("--dtype", "float32")
    arch, _ = serve.check_model(args, {"prefill": 1, "decode": 1})
    monkeypatch.setattr(serve, "_mem_available", lambda: 1 << 30)
    with pytest.raises(ValueError, match=r"2 worker processes need 3\.\d GiB \(0\.50 GiB weights \+ 1\.00 GiB KV pool "
                                         r"each\) but this machine has 1\.0 GiB available: use fewer replicas"):
        serve.check_cpu_memory(arch, args, {"prefill": 1, "decode": 1}, 2)


def test_the_memory_check_counts_the_amx_row_major_weights_of_bf16_workers(monkeypatch):
    """bf16 on an AMX CPU: each worker may keep its linears' row-major weights beside oneDNN's
    packed ones (PackedLinear.rows), so the check counts the weights twice there, once elsewhere."""
    args = parse("--dtype", "bfloat16")
    arch, _ = serve.check_model(args, {"prefill": 1, "decode": 1})
    weights, kv = arch.num_params * 2, 1 << 30
    monkeypatch.setattr(serve, "_mem_available", lambda: 2 * (weights + kv) + weights)   # fits with one copy
    monkeypatch.setattr(serve, "cpu_has_amx_bf16", lambda: False)
    serve.check_cpu_memory(arch, args, {"prefill": 1, "decode": 1}, 2)
    monkeypatch.setattr(serve, "cpu_has_amx_bf16", lambda: True)
    with pytest.raises(ValueError, match=r"\(0\.25 GiB weights \+ 0\.25 GiB AMX row-major weights \+ 1\.00 GiB"):
        serve.check_cpu_memory(arch, args, {"prefill": 1, "decode": 1}, 2)


def test_the_memory_check_counts_the_gguf_blocks_workers_keep_beside_the_dense_weights(monkeypatch):
    from engine.gguf_file import QTYPES, GGUFFile

    args = parse("--dtype", "float32")
    arch, path = serve.check_model(args, {"prefill": 1, "decode": 1})
    gguf = GGUFFile(path)
    blocks = gguf.kernel_block_bytes()
    # SmolLM2's GGUF: every linear Q4_1 and the tied embedding Q8_0, ~96 MB, the kernel reads all of them.
    assert blocks == sum(t.data.nbytes for t in gguf.tensors if len(t.shape) == 2) and 90e6 < blocks < 100e6
    assert {t.tensor_type for t in gguf.tensors if len(t.shape) == 2} <= set(QTYPES)
    weights, kv = arch.num_params * 4, 1 << 30      # float32 weights, the default 1 GiB KV pool
    monkeypatch.setattr(serve, "_mem_available", lambda: 2 * (weights + kv) + blocks)   # fits without the blocks
    with pytest.raises(ValueError, match=r"\(0\.50 GiB weights \+ 0\.09 GiB GGUF blocks \+ 1\.00 GiB KV pool each\) "
                                         r".*--gguf-kernels off, or a smaller --kv-cache-memory"):
        serve.check_cpu_memory(arch, args, {"prefill": 1, "decode": 1}, 2, path)
    serve.check_cpu_memory(arch, parse("--dtype", "float32", "--gguf-kernels", "off"), {"prefill": 1, "decode": 1}, 2,
                           path)


def test_cli_startup_errors_exit_2_before_touching_ray():
    done = run_cli("serve", "--tp", "2")
    assert done.returncode == 2
    assert "tandem serve: error: prefill TP size 2 does not divide" in done.stderr
    done = run_cli("serve", "--prefill", "0")
    assert done.returncode == 2 and "--prefill and --decode must be >= 1" in done.stderr


def test_restart_policy_backs_off_then_reports_crashloop():
    r = Replica("decode-0", "decode", 1, state="running", ever_ready=True, up_since=100.0, address="a:1")
    record_failure(r, "rank 0 exited with code -9", now=101.0)
    assert (r.state, r.next_start, r.failures, r.address) == ("restarting", 101.0, 1, "")
    r.up_since = 102.0
    record_failure(r, "again", now=103.0)
    assert r.state == "restarting" and r.next_start == 105.0
    for _ in range(CRASHLOOP_AFTER):
        r.up_since = 110.0
        record_failure(r, "still dying", now=111.0)
    assert r.state == "crashloop" and r.last_error == "still dying"
    assert r.next_start - 111.0 == min(MAX_BACKOFF_S, 2.0 ** (r.failures - 1))
    r.up_since = 200.0                                    # up long enough: forgiven
    record_failure(r, "once", now=200.0 + STABLE_AFTER_S + 1)
    assert r.state == "restarting" and r.failures == 1


def test_restart_policy_gives_up_on_config_errors_and_on_replicas_that_never_came_up():
    r = Replica("prefill-0", "prefill", 1)
    record_failure(r, "exited before it was ready (exit code 2)", now=0.0, config_error=True)
    assert r.state == "failed"
    r = Replica("prefill-1", "prefill", 1)
    for i in range(CRASHLOOP_AFTER):
        record_failure(r, "killed while loading", now=float(i))
    assert r.state == "failed"


def test_a_scale_down_drains_what_does_not_serve_then_the_emptiest_running_replica():
    from types import SimpleNamespace

    from deploy.controller import drain_order

    live = [Replica(f"decode-{i}", "decode", 1, state="running", address=f"d:{i}") for i in range(3)]
    live.append(Replica("decode-3", "decode", 1, state="starting", address="d:3"))
    view = {"d:0": SimpleNamespace(num_running=20, num_inflight=25),    # streams: its drain waits for them
            "d:1": SimpleNamespace(num_running=5, num_inflight=30),     # requests without a token move
            "d:2": SimpleNamespace(num_running=12, num_inflight=3)}
    assert [r.id for r in drain_order(live, view)] == ["decode-3", "decode-1", "decode-2", "decode-0"]
    # The router did not answer: the newest first, as before.
    assert [r.id for r in drain_order(live, None)] == ["decode-3", "decode-2", "decode-1", "decode-0"]


def test_a_drain_the_router_did_not_take_is_asked_again():
    from types import SimpleNamespace

    from deploy.controller import DRAIN_ASK_AGAIN_S, drain_lost

    r = Replica("decode-1", "decode", 1, state="draining", address="d:1", drain_asked_s=100.0)
    routed, draining = SimpleNamespace(draining=False), SimpleNamespace(draining=True)
    # The router still routes to it: asked again once the last call is DRAIN_ASK_AGAIN_S old.
    assert not drain_lost(r, routed, 100.0 + DRAIN_ASK_AGAIN_S - 1)
    assert drain_lost(r, routed, 100.0 + DRAIN_ASK_AGAIN_S)
    # The router drains it, or no longer lists it (_sync_router registers and drains those).
    assert not drain_lost(r, draining, 1000.0) and not drain_lost(r, None, 1000.0)


def test_serve_forwards_the_public_api_flags_that_differ_from_the_defaults():
    from router.__main__ import parse_args as router_args
    from router.config import public_api_flags

    assert public_api_flags(parse()) == []
    given = ["--max-waiting", "7", "--max-sub-requests", "3", "--max-prompt-chars", "1000",
             "--max-request-body-bytes", "4096", "--allowed-hosts", "api.example:8000",
             "--tool-call-parser", "hermes", "--no-enable-auto-tool-choice"]
    flags = public_api_flags(parse(*given))
    assert sorted(flags) == sorted(given)
    config = router_args(["--model", "m", *flags])
    assert (config.max_waiting, config.max_sub_requests, config.max_prompt_chars, config.max_request_body_bytes,
            config.tool_call_parser, config.enable_auto_tool_choice) == (7, 3, 1000, 4096, "hermes", False)


def test_local_prefill_is_on_by_default_only_on_one_cpu_node():
    from deploy.serve import CPU_LOCAL_PREFILL_MAX_TOKENS, local_prefill_max_tokens
    assert parse().local_prefill_max_tokens is None
    assert local_prefill_max_tokens(None, use_gpu=False, num_nodes=1) == CPU_LOCAL_PREFILL_MAX_TOKENS
    assert local_prefill_max_tokens(None, use_gpu=True, num_nodes=1) == 0
    assert local_prefill_max_tokens(None, use_gpu=False, num_nodes=2) == 0
    assert local_prefill_max_tokens(0, use_gpu=False, num_nodes=1) == 0
    assert local_prefill_max_tokens(512, use_gpu=True, num_nodes=3) == 512


NODES = [{"NodeID": "a" * 56, "NodeManagerAddress": "10.0.0.10", "NodeManagerHostname": "head", "Alive": True},
         {"NodeID": "b" * 56, "NodeManagerAddress": "10.0.0.11", "NodeManagerHostname": "gpu-1", "Alive": True},
         {"NodeID": "c" * 56, "NodeManagerAddress": "10.0.0.12", "NodeManagerHostname": "gpu-2", "Alive": False}]


def test_a_role_is_placed_on_the_alive_nodes_named_by_address_or_hostname():
    from deploy.controller import matching_nodes

    assert [n["NodeManagerHostname"] for n in matching_nodes([], NODES)] == ["head", "gpu-1"]
    assert [n["NodeManagerHostname"] for n in matching_nodes(["gpu-1", "10.0.0.10"], NODES)] == ["head", "gpu-1"]
    assert matching_nodes(["10.0.0.12"], NODES) == []       # dead: waited for, not placed on


def test_node_flags_must_name_alive_nodes_and_a_remote_router_must_listen_beyond_loopback():
    assert parse("--decode-nodes", "gpu-1,10.0.0.10").decode_nodes == ["gpu-1", "10.0.0.10"]
    serve.check_node_sets({"prefill": ["head"], "decode": ["gpu-1"], "router": ["gpu-1"]}, NODES, "0.0.0.0")
    with pytest.raises(serve.ServeError, match=r"--decode-nodes: no alive Ray node is 'gpu-2'; the cluster has "
                                               r"10.0.0.10 \(head\), 10.0.0.11 \(gpu-1\)"):
        serve.check_node_sets({"decode": ["gpu-2"]}, NODES, "127.0.0.1")
    with pytest.raises(serve.ServeError, match="--router-node with --host 127.0.0.1"):
        serve.check_node_sets({"router": ["gpu-1"]}, NODES, "127.0.0.1")
    with pytest.raises(serve.ServeError, match="one node"):
        serve.check_node_sets({"router": ["head", "gpu-1"]}, NODES, "0.0.0.0")


def test_status_says_why_the_router_is_down():
    status = {"model": "m", "desired": {"prefill": 1, "decode": 1}, "workers": [],
              "router": {"http": "0.0.0.0:8000", "grpc": "0.0.0.0:50051", "node": "10.0.0.11", "pid": None,
                         "state": "down", "error": "the router's process host died: node lost; restart failed: "
                                                   "no node of --router-node 10.0.0.11 is alive"}}
    text = serve.render_status(status)
    assert "node 10.0.0.11, down)" in text
    assert "router: the router's process host died: node lost; restart failed: no node of --router-node" in text


def test_planner_flags():
    assert serve.planner_config(parse()) is None
    config = serve.planner_config(parse("--planner", "--ttft-slo-ms", "800", "--itl-slo-ms", "60", "--max-workers",
                                        "6", "--planner-interval-s", "2", "--planner-dry-run"))
    assert (config.ttft_slo_s, config.itl_slo_s, config.max_workers, config.interval_s, config.cooldown_s,
            config.dry_run) == (0.8, 0.06, 6, 2.0, 6.0, True)
    with pytest.raises(serve.ServeError, match="--ttft-slo-ms without --planner"):
        serve.planner_config(parse("--ttft-slo-ms", "800"))
    with pytest.raises(serve.ServeError, match="needs both --ttft-slo-ms and --itl-slo-ms"):
        serve.planner_config(parse("--planner", "--ttft-slo-ms", "800"))
    with pytest.raises(serve.ServeError, match="--prefill 3 \\+ --decode 2 is more than --max-workers 4"):
        serve.planner_config(parse("--planner", "--ttft-slo-ms", "800", "--itl-slo-ms", "60", "--prefill", "3",
                                   "--decode", "2", "--max-workers", "4"))
    with pytest.raises(serve.ServeError, match="--itl-slo-ms must be > 0"):
        serve.planner_config(parse("--planner", "--ttft-slo-ms", "800", "--itl-slo-ms", "0"))


def test_address_local_always_starts_its_own_ray(monkeypatch):
    """`--address local` must not join a cluster another `tandem serve --address local` on the same
    machine started: Ray's address=None reads /tmp/ray/ray_current_cluster and joins that one, and
    the second deployment then fails with "already running"."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    assert serve.connect("local", may_start=True) == "local"
    assert calls and calls[0].get("address") == "local"


def test_replicas_that_can_never_be_placed_are_named_with_the_flag_to_change():
    from deploy.controller import ServeSpec, placement_shortfall

    spec = ServeSpec(model="m", replicas={"prefill": 16, "decode": 48}, tp={"prefill": 1, "decode": 1},
                     worker_flags=[], router_flags=[])
    # 64 ranks x 0.1 + the router's 0.1 = 6.5 CPUs on 2: what fits is (2 - 0.1) / 64 = 0.0296 each.
    assert placement_shortfall(spec, spec.replicas, {"CPU": 2.0}) == (
        "16 prefill + 48 decode workers (64 ranks) at 0.1 CPU each (--cpus-per-worker) and the router's 0.1 need "
        "6.5 CPUs; this Ray cluster has 2: use --cpus-per-worker 0.029 or less, fewer workers, or more nodes")
    assert placement_shortfall(spec, {"prefill": 1, "decode": 18}, {"CPU": 2.0}) == ""        # 1.9 + 0.1
    assert placement_shortfall(spec, {"prefill": 1, "decode": 19}, {"CPU": 2.0}).startswith("1 prefill + 19 decode")
    gpu = ServeSpec(model="m", replicas={"prefill": 1, "decode": 1}, tp={"prefill": 2, "decode": 2},
                    worker_flags=[], router_flags=[], use_gpu=True)
    assert placement_shortfall(gpu, {"prefill": 1, "decode": 2}, {"CPU": 64.0, "GPU": 4.0}) == (
        "1 prefill + 2 decode workers (6 ranks with TP) need 6 GPUs; this Ray cluster has 4: use fewer workers or "
        "add GPU nodes")
    assert placement_shortfall(gpu, {"prefill": 1, "decode": 1}, {"CPU": 64.0, "GPU": 4.0}) == ""


def test_a_router_call_on_a_channel_closed_by_a_restart_counts_as_no_answer():
    """The reconcile thread restarts a dead router and closes the old channel while another thread
    (`tandem status`, a scale) may be calling on it: grpc then raises ValueError, not an RpcError,
    and `tandem status` failed with it in a chaos soak. The controller's router calls treat it as
    "the router did not answer"."""
    import grpc

    from deploy.controller import ROUTER_CALL_ERRORS
    from protos.tandem.v1 import tandem_pb2, tandem_pb2_grpc

    channel = grpc.insecure_channel("127.0.0.1:1")
    stub = tandem_pb2_grpc.TandemStub(channel)
    channel.close()
    with pytest.raises(ROUTER_CALL_ERRORS):
        stub.GetCluster(tandem_pb2.GetClusterRequest(), timeout=1.0)
