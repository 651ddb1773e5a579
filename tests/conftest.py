"""Session-wide test setup.

Every test session is one deployment: one cluster secret (protos/auth.py) in the environment,
so in-process routers and the worker processes tests start (they inherit it) trust each other.

Under ``TANDEM_CI=1`` (set by .ci/run) a skipped test is a failed one, unless its reason says it
needs CUDA / a GPU: CI must never be green with, say, every SmolLM2 test skipped because the
model package is missing, or the ``ray up`` test skipped for want of sshd.
"""
from __future__ import annotations

import os
import re

import pytest

from protos.grpc_io import use_polling_io

use_polling_io()   # grpc's I/O path as in Tandem's processes, before protos.auth imports grpc

from protos.auth import SECRET_ENV, new_secret  # noqa: E402

os.environ.setdefault(SECRET_ENV, new_secret())

CI_ENV = "TANDEM_CI"
MAY_SKIP_IN_CI = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:   # (path, lineno, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _fail_skip_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    if os.environ.get(CI_ENV) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if MAY_SKIP_IN_CI.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under {CI_ENV}=1, where only tests that need CUDA or a GPU may skip: "
                       f"{reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())
