"""Block until every node `ray up` asked for has joined the Ray cluster.

Runs on the head node from the cluster YAMLs' `head_start_ray_commands`, between `ray start
--head` and `tandem serve`. The autoscaler launches and sets up the worker nodes only after the
head is up, and `tandem serve` places its workers on the nodes (and GPUs) it sees when it
starts, so it must not start before them. The number to wait for comes from the config `ray
up` copied to the head: the head plus each node type's `min_workers` (for the `local` provider,
one per `worker_ips` entry).

    python wait_for_nodes.py [--config ~/ray_bootstrap_config.yaml] [--timeout-s 1800]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ray
import yaml

POLL_S = 5.0
NOTE_EVERY_S = 60.0


def expected_nodes(config: dict) -> int:
    return 1 + sum(node_type.get("min_workers", 0) for node_type in config["available_node_types"].values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path.home() / "ray_bootstrap_config.yaml")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)

    wanted = expected_nodes(yaml.safe_load(args.config.read_text()))
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)  # type: ignore[arg-type]  # a name works too
    started = time.monotonic()
    last_note = started
    try:
        while (alive := sum(node["Alive"] for node in ray.nodes())) < wanted:
            waited_s = time.monotonic() - started
            if waited_s > args.timeout_s:
                print(f"only {alive} of {wanted} nodes joined within {args.timeout_s:.0f} s; "
                      "`ray monitor <cluster.yaml>` shows why", file=sys.stderr)
                return 1
            if time.monotonic() - last_note >= NOTE_EVERY_S:
                last_note = time.monotonic()
                print(f"waiting for nodes: {alive} of {wanted} joined after {waited_s:.0f} s", flush=True)
            time.sleep(POLL_S)
    finally:
        ray.shutdown()
    print(f"{wanted} of {wanted} nodes joined", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
