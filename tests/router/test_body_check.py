"""The body-check child process (router/body_check.py): it refuses what the router's own check
refuses, in the same words, and it does not outlive a router process that is killed."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from router import errors
from router.body_check import ChildCheck, SizeLimits, check_sizes
from router.openai_types import CompletionRequest, parse_body

pytestmark = pytest.mark.timeout(60)
REPO_ROOT = Path(__file__).resolve().parents[2]
LIMITS = SizeLimits(max_sub_requests=8, max_prompt_chars=1000, max_model_len=64)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a"] * 9}, "prompt"),
    ({"prompt": [[1] * 64]}, "prompt.0"),
    ({"prompt": [1] * 2000}, "prompt"),
    ({"messages": []}, "messages"),
])
def test_the_child_refuses_like_the_router(body, param):
    raw = json.dumps(body).encode()
    with pytest.raises(errors.RouterError) as here:
        parse_body(raw, CompletionRequest, lambda data: check_sizes(data, LIMITS))
    with pytest.raises(errors.RouterError) as there:
        asyncio.run(ChildCheck.refuse(raw, False, LIMITS))
    assert (there.value.message, there.value.param) == (here.value.message, here.value.param)
    assert there.value.param == param and there.value.http_status == 400
    assert asyncio.run(ChildCheck.refuse(json.dumps({"prompt": "fine"}).encode(), False, LIMITS)) is None
    ChildCheck.shutdown()


def test_the_child_exits_when_its_router_is_killed():
    script = textwrap.dedent("""
        import asyncio, json, multiprocessing, sys, time
        from router.body_check import ChildCheck, SizeLimits
        asyncio.run(ChildCheck.refuse(b'{"prompt": "x"}', False, SizeLimits(8, 100, None)))
        print(json.dumps([p.pid for p in multiprocessing.active_children()]), flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        children = json.loads(proc.stdout.readline())
        assert len(children) == 1 and _alive(children[0])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(children[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(children[0]), "the body-check child outlived its killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
