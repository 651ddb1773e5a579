"""The cluster YAMLs under deploy/ pass Ray's own config checks and start Tandem on the head.

`ray up` loads a YAML, runs `prepare_config` (defaults, the local provider's node types,
setup-command merging) and then `validate_config` (Ray's JSON schema) before it contacts any
cloud; these tests run the same two steps, offline.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import click
import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from deploy.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((REPO_ROOT / "deploy").rglob("*.yaml"))


def _wait_for_nodes_module():
    """deploy/ray/wait_for_nodes.py is a script run on the head, not part of a package."""
    spec = importlib.util.spec_from_file_location("wait_for_nodes", REPO_ROOT / "deploy/ray/wait_for_nodes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ray_checked(config: dict) -> dict:
    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _tandem_argv(command: str) -> list[str] | None:
    """The arguments of a `tandem ...` invocation inside a shell command, or None."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "tandem" or word.endswith("/tandem"):
            return words[i + 1:]
    return None


def test_both_examples_are_found():
    names = {path.relative_to(REPO_ROOT).as_posix() for path in CLUSTER_YAMLS}
    assert {"deploy/ray/cluster-gpu.yaml", "deploy/ray/cluster-local.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_ray_accepts_the_yaml(path):
    _ray_checked(_load(path))


def _check_head_serves_tandem(config: dict) -> None:
    head_commands = config["head_start_ray_commands"]
    ray_start = [i for i, cmd in enumerate(head_commands) if "ray start --head" in cmd]
    serve = [i for i, cmd in enumerate(head_commands) if (_tandem_argv(cmd) or [None])[0] == "serve"]
    assert len(ray_start) == 1 and len(serve) == 1, \
        f"want one 'ray start --head' and one 'tandem serve': {head_commands}"
    assert ray_start[0] < serve[0], f"'tandem serve' before 'ray start --head': {head_commands}"

    args = build_parser().parse_args(_tandem_argv(head_commands[serve[0]]))
    assert args.address == "auto", f"'tandem serve' without --address auto: {head_commands[serve[0]]}"
    # Without --detach `ray up` would wait on the server forever.
    assert args.detach, f"'tandem serve' without --detach: {head_commands[serve[0]]}"


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_the_head_starts_ray_then_serves_tandem(path):
    _check_head_serves_tandem(_ray_checked(_load(path)))


@pytest.mark.parametrize("edit, caught_by", [
    pytest.param(lambda cmd: cmd.replace(" --detach", ""), "without --detach", id="no-detach"),
    pytest.param(lambda cmd: cmd.replace("--address auto", "--address local"), "without --address auto",
                 id="own-cluster"),
    pytest.param(lambda cmd: cmd.replace(" serve ", " status "), "want one 'ray start --head' and one 'tandem serve'",
                 id="no-serve"),
])
def test_a_head_that_does_not_serve_tandem_is_caught(edit, caught_by):
    config = _ray_checked(_load(REPO_ROOT / "deploy/ray/cluster-local.yaml"))
    config["head_start_ray_commands"] = [edit(cmd) for cmd in config["head_start_ray_commands"]]
    with pytest.raises(AssertionError, match=re.escape(caught_by)):
        _check_head_serves_tandem(config)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_node_installs_tandem_with_the_project_installer(path):
    config = _ray_checked(_load(path))
    for role in ("head_setup_commands", "worker_setup_commands"):
        assert any("bash scripts/setup.sh" in cmd for cmd in config[role]), role
    # The checkout the installer runs in is shipped from the directory `ray up` runs in, and
    # every node gets the launching machine's Ray token.
    assert config["file_mounts"]["~/tandem"] == "."
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_ray_start_uses_token_authentication(path):
    config = _load(path)
    starts = [cmd for role in ("head_start_ray_commands", "worker_start_ray_commands") for cmd in config[role]
              if "ray start" in cmd or "tandem serve" in cmd or "wait_for_nodes" in cmd]
    assert len(starts) == 4, starts
    for cmd in starts:
        assert "RAY_AUTH_MODE=token " in cmd, cmd
    assert any("export RAY_AUTH_MODE=token" in cmd for cmd in config["setup_commands"])


@pytest.mark.parametrize("name, nodes", [("cluster-local.yaml", 3), ("cluster-gpu.yaml", 4)])
def test_the_head_waits_for_every_node_the_config_asks_for(name, nodes):
    # local: the head + 2 worker_ips; gpu: a CPU head + gpu.min_workers 3.
    config = _ray_checked(_load(REPO_ROOT / "deploy/ray" / name))
    assert _wait_for_nodes_module().expected_nodes(config) == nodes
    waits = [i for i, cmd in enumerate(config["head_start_ray_commands"]) if "wait_for_nodes.py" in cmd]
    serve = [i for i, cmd in enumerate(config["head_start_ray_commands"]) if " serve " in cmd]
    assert len(waits) == 1 and waits[0] < serve[0]


@pytest.mark.parametrize("breakage, error, message", [
    # A misspelt section is not silently ignored.
    pytest.param(lambda c: c.update(setup_comands=c.pop("setup_commands")), jsonschema.ValidationError,
                 "'setup_comands' was unexpected", id="misspelt-section"),
    pytest.param(lambda c: c.update(max_workers="four"), jsonschema.ValidationError,
                 "'four' is not of type 'integer'", id="wrong-type"),
    pytest.param(lambda c: c["auth"].update(ssh_port=2222), jsonschema.ValidationError,
                 "'ssh_port' was unexpected", id="unknown-auth-field"),
    pytest.param(lambda c: c.update(head_start_ray_commands="ray start --head"), jsonschema.ValidationError,
                 "'ray start --head' is not of type 'array'", id="commands-not-a-list"),
    pytest.param(lambda c: c["provider"].update(type="nosuchcloud"), NotImplementedError,
                 "Unsupported node provider: nosuchcloud", id="unknown-provider"),
])
def test_a_broken_copy_is_rejected(breakage, error, message):
    config = _load(REPO_ROOT / "deploy/ray/cluster-gpu.yaml")
    breakage(config)
    with pytest.raises(error, match=re.escape(message)):
        _ray_checked(config)


def test_a_local_cluster_without_a_head_ip_is_rejected():
    config = _load(REPO_ROOT / "deploy/ray/cluster-local.yaml")
    del config["provider"]["head_ip"]
    with pytest.raises(click.ClickException, match="head_ip"):  # Ray's cli_logger.abort
        _ray_checked(config)
