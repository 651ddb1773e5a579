"""Where `tandem serve`'s workers bind, and how the cluster secret reaches them: on one node
every internal endpoint binds 127.0.0.1; the secret travels in the environment, never in argv
or a repr."""
from __future__ import annotations

from deploy.controller import ServeSpec, worker_argvs
from deploy.serve import internal_host
from protos.auth import SECRET_ENV, new_secret

NODE = {"ip": "10.1.2.3", "node_id": "n1", "cpus": 8}


def _spec(num_nodes: int, secret: str) -> ServeSpec:
    return ServeSpec(model="m", replicas={"prefill": 1, "decode": 1}, tp={"prefill": 2, "decode": 2},
                     worker_flags=[], router_flags=[], cluster_secret=secret, internal_host=internal_host(num_nodes))


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_one_node_workers_bind_every_internal_endpoint_to_loopback():
    argvs = worker_argvs(_spec(1, new_secret()), "decode", 2, NODE, ranks={"prefill": 2, "decode": 2}, dist_port=29500)
    assert [_flag(a, "--host") for a in argvs] == ["127.0.0.1", "127.0.0.1"]   # gRPC, /metrics, kvtransfer
    assert [_flag(a, "--dist-init-address") for a in argvs] == ["127.0.0.1:29500"] * 2   # the TP store
    assert [_flag(a, "--tp-rank") for a in argvs] == ["0", "1"]


def test_multi_node_workers_bind_their_node_address():
    argvs = worker_argvs(_spec(3, new_secret()), "prefill", 2, NODE, ranks={"prefill": 2, "decode": 2}, dist_port=29500)
    assert [_flag(a, "--host") for a in argvs] == ["10.1.2.3", "10.1.2.3"]
    assert [_flag(a, "--dist-init-address") for a in argvs] == ["10.1.2.3:29500"] * 2


def test_the_cluster_secret_is_in_the_environment_not_on_a_command_line_or_in_a_repr():
    secret = new_secret()
    spec = _spec(1, secret)
    argvs = worker_argvs(spec, "decode", 2, NODE, ranks={"prefill": 2, "decode": 2}, dist_port=29500)
    assert not any(secret in arg for argv in argvs for arg in argv)
    assert spec.secret_env() == {SECRET_ENV: secret}
    assert secret not in repr(spec)
