"""Prometheus file-based service discovery for a ``tandem serve`` deployment.

Runs in the controller actor (deploy/controller.py), on the node ``tandem serve`` ran on. Each
reconcile tick the controller hands ``TargetFile.publish`` the router and its replicas; when the
set of scrape targets changed, the file is rewritten atomically (a temporary file renamed over
it), so Prometheus' ``file_sd_configs`` never reads half a list. The format is Prometheus'
file_sd JSON: a list of ``{"targets": ["host:port"], "labels": {...}}`` groups.

Labels: ``role`` (router, prefill, decode, planner), ``replica`` (prefill-0, ..., router or
planner) and ``node``. The router's series carry no ``role`` of their own, so this label is how the dashboard
tells them from the workers' series of the same name; the workers' own ``role`` agrees with it.
Only rank 0 of a replica serves /metrics (followers run its steps and have no scheduler).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_SD_FILE = "/tmp/tandem/prometheus/targets.json"
SCRAPED_STATES = ("running", "draining")     # draining replicas still finish requests: keep watching them
_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def scrape_address(bind: str, node_ip: str) -> str:
    """``host:port`` Prometheus can reach for a server bound to ``bind`` (a wildcard bind is
    reached at the node's address)."""
    host, _, port = bind.rpartition(":")
    return f"{node_ip}:{port}" if host in _WILDCARDS and node_ip else bind


def target_groups(router: dict[str, Any], replicas: Iterable[Any], planner: str = "") -> list[dict[str, Any]]:
    """The file_sd groups for the router (``Controller.router``: http, node), every replica
    (``Replica``: id, role, state, node, metrics) that serves and the SLO planner's /metrics
    (``planner``: host:port, "" = none; it runs in the controller, on the router's node unless
    --router-node moved the router). Sorted, so equal membership gives an equal list."""
    groups = []
    if planner:
        groups.append({"targets": [planner],
                       "labels": {"role": "planner", "replica": "planner", "node": planner.rpartition(":")[0]}})
    if router.get("http"):
        groups.append({"targets": [scrape_address(router["http"], router.get("node", ""))],
                       "labels": {"role": "router", "replica": "router", "node": router.get("node", "")}})
    for r in replicas:
        if r.state in SCRAPED_STATES and r.metrics:
            groups.append({"targets": [scrape_address(r.metrics, r.node)],
                           "labels": {"role": r.role, "replica": r.id, "node": r.node}})
    return sorted(groups, key=lambda g: (g["labels"]["role"], g["labels"]["replica"]))


class TargetFile:
    """The target list at ``path``, rewritten only when it changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._written: list[dict[str, Any]] | None = None

    def publish(self, groups: list[dict[str, Any]]) -> bool:
        """Write ``groups`` if they differ from what was last written; True when written. An
        unwritable path is logged, not raised: monitoring must not stop the deployment."""
        if groups == self._written:
            return False
        try:
            self._write(json.dumps(groups, indent=2) + "\n")
        except OSError as exc:
            logger.warning("cannot write the Prometheus target file %s: %s", self.path, exc)
            return False
        self._written = groups
        logger.info("Prometheus targets in %s: %s", self.path,
                    ", ".join(f"{g['labels']['replica']}={g['targets'][0]}" for g in groups) or "none")
        return True

    def _write(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)   # mkstemp makes 0600; a Prometheus running as its own user must read it
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
