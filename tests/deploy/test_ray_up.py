"""`ray up` with deploy/ray/cluster-local.yaml launches a Tandem cluster that answers a chat.

The "remote" head node is this machine, reached through a private sshd on 127.0.0.1 whose
sessions get a temp HOME (so ~/tandem, ~/.bashrc and Ray's bootstrap files stay in tmp_path).
The YAML is the shipped one with four changes: the machines and login, a unique cluster name,
this checkout's venv linked in place of running the installer (minutes), and router ports
picked by the router (port 0; the test reads the address `tandem serve` prints). Everything
else (file_mounts, the PATH line, ray start, `tandem serve --address auto --detach`) runs as
shipped.

`ray up` here stops and starts Ray on this machine, so the test refuses to run next to
another Ray cluster rather than stop it.
"""
from __future__ import annotations

import json
import re
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.ray_launcher import launcher_home, ray_cli
from tests.deploy.sshd import PrivateSshd, missing_binaries, process_table, processes_with_env, terminate

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_YAML = REPO_ROOT / "deploy/ray/cluster-local.yaml"
UP_TIMEOUT_S = 480
DOWN_TIMEOUT_S = 120


@pytest.fixture
def sshd(tmp_path):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"needs OpenSSH server/client and rsync; missing: {', '.join(missing)} "
                    "(apt-get install openssh-server openssh-client rsync)")
    server = PrivateSshd(tmp_path / "ssh")
    yield server
    server.stop()


def _ray_daemons() -> list[str]:
    markers = (b"/raylet", b"/gcs_server")
    return [argv.replace(b"\0", b" ").decode(errors="replace")
            for argv in (argv for _, argv in process_table().values())
            if any(argv.split(b"\0")[0].endswith(marker) for marker in markers)]


def _test_config(sshd: PrivateSshd, venv: Path) -> dict:
    config = yaml.safe_load(SHIPPED_YAML.read_text())
    config["cluster_name"] = f"tandem-test-{uuid.uuid4().hex[:8]}"
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": sshd.user, "ssh_private_key": str(sshd.client_key),
                      "ssh_proxy_command": sshd.proxy_command}

    installs = [i for i, cmd in enumerate(config["setup_commands"]) if "bash scripts/setup.sh" in cmd]
    assert len(installs) == 1, config["setup_commands"]
    config["setup_commands"][installs[0]] = f"ln -sfn {venv} ~/tandem/.venv"

    serves = [i for i, cmd in enumerate(config["head_start_ray_commands"]) if " serve --address auto" in cmd]
    assert len(serves) == 1, config["head_start_ray_commands"]
    # Port 0: the router picks free ports, so a busy 8000 or 50051 on this machine does not matter.
    config["head_start_ray_commands"][serves[0]] += " --http-port 0 --grpc-port 0"
    return config


def _remove_config_cache(config_path: Path) -> None:
    """`ray down` (it has no --no-config-cache) leaves the resolved config in the temp dir."""
    name = yaml.safe_load(config_path.read_text())["cluster_name"]
    for path in Path(tempfile.gettempdir()).glob("ray-config-*"):
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if cached.get("config", {}).get("cluster_name") == name:
            path.unlink()


def _chat(base: str) -> str:
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{base}/models").raise_for_status().json()["data"][0]["id"]
        reply = client.post(f"{base}/chat/completions", json={
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 16,
        }).raise_for_status().json()
    return reply["choices"][0]["message"]["content"]


@pytest.mark.timeout(UP_TIMEOUT_S + 3 * DOWN_TIMEOUT_S + 60)
def test_ray_up_launches_a_cluster_that_answers_a_chat(sshd, tmp_path):
    running = _ray_daemons()
    if running:
        pytest.fail("a Ray cluster already runs on this machine and `ray up` on 127.0.0.1 would "
                    "stop it; stop it first:\n" + "\n".join(running))
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(_test_config(sshd, REPO_ROOT / ".venv")))
    ours = f"HOME={sshd.home}"  # every process the cluster starts inherits the session's HOME
    home = launcher_home(tmp_path)
    logs = []
    try:
        started = time.monotonic()
        rc, out = ray_cli("up", "-y", str(config_path), "--no-config-cache", "--log-style", "record",
                       home=home, timeout_s=UP_TIMEOUT_S)
        logs.append(f"$ ray up ({time.monotonic() - started:.0f} s, exit {rc})\n{out}")
        assert rc == 0, f"`ray up` failed:\n{out[-4000:]}"

        # `tandem serve` prints the router's OpenAI base URL, http://HOST:PORT/v1.
        urls = re.findall(r"http://[^\s/]+:\d+/v1", out)
        assert urls, f"no router address in the `ray up` output:\n{out[-4000:]}"
        answer = _chat(urls[-1])
        assert answer.strip(), answer
    finally:
        # `tandem down` through the login shell also checks the PATH line the YAML installs.
        rc, out = ray_cli("exec", str(config_path), "tandem down", "--no-config-cache", home=home,
                     timeout_s=DOWN_TIMEOUT_S)
        logs.append(f"$ ray exec 'tandem down' (exit {rc})\n{out}")
        rc, out = ray_cli("down", "-y", str(config_path), "--log-style", "record", home=home, timeout_s=DOWN_TIMEOUT_S)
        logs.append(f"$ ray down (exit {rc})\n{out}")
        table = process_table()
        left_after_down = {pid: table[pid][1] for pid in processes_with_env(ours) if pid in table}
        # The fallback stops exactly this cluster's processes; `ray stop` would stop every Ray
        # process on the machine, other users' clusters included.
        terminate(list(left_after_down))
        _remove_config_cache(config_path)
        print("\n\n".join(logs))  # pytest shows it when the test fails
    assert not left_after_down, "left running after `tandem down` and `ray down`:\n" + "\n".join(
        argv.replace(b"\0", b" ").decode(errors="replace") for argv in left_after_down.values())
