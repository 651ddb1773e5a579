"""A request body's counts, checked before pydantic builds it; in a child process for a body whose
parse would hold the GIL long (router process).

The HTTP API parses a large body off the event loop (router/http_api.py), but orjson holds the
GIL while it builds the objects: a 15 MB body of 3M one-token prompts held the loop ~0.2-0.5 s
(``/health`` waited that long) only to be refused for its prompt count. So a body longer than
``CHILD_CHECK_BYTES`` with more than ``CHILD_CHECK_COMMAS`` commas (a cheap bound on the values
it can hold) is first parsed and checked by ``parse_body`` in a child process, and refused from
there; only a body the child finds nothing wrong with is parsed again in the router. Smaller or
flatter bodies (a long text is one value) parse in milliseconds and skip the child. The child is
one spawned process, started on first use and kept, that exits with the router (even a killed
one); if it dies or is slow the router parses the body itself, as it did before.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from router import errors
from router.frontend import Frontend  # its message-count rule (gRPC uses it too)

logger = logging.getLogger(__name__)

CHILD_CHECK_BYTES = 1 << 20
CHILD_CHECK_COMMAS = 100_000
CHILD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SizeLimits:
    max_sub_requests: int
    max_prompt_chars: int
    max_model_len: int | None     # None until a worker told the router


def check_sizes(data: dict, limits: SizeLimits) -> None:
    """On the parsed JSON, before pydantic validates element by element: how many prompts,
    token ids per prompt and messages (a 12 MB body holds 3M one-token prompts)."""
    prompt, messages = data.get("prompt"), data.get("messages")
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], (list, str)):
            if len(prompt) > limits.max_sub_requests:
                raise errors.invalid_request(f"{len(prompt)} prompts, more than max_sub_requests="
                                             f"{limits.max_sub_requests}", "prompt")
            for i, ids in enumerate(prompt):
                if isinstance(ids, list):
                    _check_num_token_ids(len(ids), f"prompt.{i}", limits)
        else:
            _check_num_token_ids(len(prompt), "prompt", limits)
    if isinstance(messages, list):
        Frontend.check_num_messages(len(messages))


def _check_num_token_ids(num_tokens: int, param: str, limits: SizeLimits) -> None:
    if limits.max_model_len is not None and num_tokens >= limits.max_model_len:
        raise errors.invalid_request(f"This model's maximum context length is {limits.max_model_len} tokens, but "
                                     f"the prompt has {num_tokens} tokens; shorten the prompt", param)
    if num_tokens > limits.max_prompt_chars:   # before any worker said: no token is shorter than a char
        raise errors.invalid_request(f"the prompt has {num_tokens} token ids, more than max_prompt_chars="
                                     f"{limits.max_prompt_chars}", param)


def _refusal_in_child(raw: bytes, chat: bool, limits: SizeLimits) -> tuple[str, str | None] | None:
    """Child process: what ``parse_body`` refuses in ``raw`` (message, param), or None."""
    from router.openai_types import ChatCompletionRequest, CompletionRequest, parse_body

    try:
        parse_body(raw, ChatCompletionRequest if chat else CompletionRequest,
                   functools.partial(check_sizes, limits=limits))
    except errors.RouterError as exc:
        return exc.message, exc.param
    return None


def _exit_with_parent(parent_pid: int) -> None:
    """Child process initializer: the child leaves when the router does, even on kill -9 (its
    task queue would not tell it: the child holds both ends of the pipe)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class ChildCheck:
    """The one child process (shared by every router in this process)."""

    _lock = threading.Lock()
    _pool: ProcessPoolExecutor | None = None

    @classmethod
    def wanted(cls, raw: bytes) -> bool:
        return len(raw) > CHILD_CHECK_BYTES and raw.count(b",") > CHILD_CHECK_COMMAS

    @classmethod
    async def refuse(cls, raw: bytes, chat: bool, limits: SizeLimits) -> None:
        """Raise the 400 ``parse_body`` would give ``raw``, found in the child; return when there
        is none, or when the child could not say (the caller then parses it itself)."""
        pool = cls._executor()
        try:
            found = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(pool, _refusal_in_child, raw, chat, limits),
                CHILD_TIMEOUT_S)
        except (BrokenProcessPool, OSError) as exc:
            logger.warning("the body-check child process failed (%s); parsing in the router", type(exc).__name__)
            cls._drop(pool)
            return
        except asyncio.TimeoutError:
            logger.warning("the body-check child took over %.0f s; parsing in the router", CHILD_TIMEOUT_S)
            return
        if found is not None:
            raise errors.invalid_request(*found)

    @classmethod
    def _executor(cls) -> ProcessPoolExecutor:
        with cls._lock:
            if cls._pool is None:
                cls._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_exit_with_parent, initargs=(os.getpid(),))
            return cls._pool

    @classmethod
    def _drop(cls, pool: ProcessPoolExecutor) -> None:
        with cls._lock:
            if cls._pool is pool:
                cls._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    @classmethod
    def shutdown(cls) -> None:
        with cls._lock:
            pool, cls._pool = cls._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
