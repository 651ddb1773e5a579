"""The router's waiting queue: its drain rate and the wait it predicts (router/admission.py)."""
from __future__ import annotations

import pytest

from router.admission import MIN_DRAINED, MIN_PACED_TOKENS, DecodePace, WaitingQueue


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def serve_one_at_a_time(queue: WaitingQueue, clock: Clock, num_tokens: int, ttft_s: float, count: int) -> None:
    for _ in range(count):
        queue.enter(num_tokens)
        clock.now_s += ttft_s
        queue.leave(num_tokens, first_token=True)


def test_alike_prompts_cost_their_busy_time_per_token_and_idle_time_is_left_out():
    clock = Clock()
    queue = WaitingQueue(window_s=1e9, clock=clock)   # no decay: plain sums
    assert queue.predicted_wait_s(100) is None        # nothing measured yet
    serve_one_at_a_time(queue, clock, 200, 0.5, MIN_DRAINED)
    assert queue.cost() == pytest.approx((0.0, 0.5 / 200))
    clock.now_s += 60.0                               # a minute with nothing waiting
    assert queue.cost() == pytest.approx((0.0, 0.5 / 200))
    queue.enter(300)                                  # one waiting: 300 + 100 new tokens at 2.5 ms each
    assert queue.predicted_wait_s(100) == pytest.approx(1.0)
    assert (queue.num_requests, queue.num_tokens) == (1, 300)


def test_a_mixed_load_is_fitted_as_a_cost_per_request_plus_a_cost_per_token():
    # 0.1 s per request and 1 ms per token: a 100-token prompt waits 0.2 s, a 1,000-token one 1.1 s.
    # One tokens-per-second rate (1,100 tokens in 1.3 s) would charge a lone 1,000-token prompt 1.18 s
    # and four 100-token ones 0.47 s instead of 0.8.
    clock = Clock()
    queue = WaitingQueue(window_s=1e9, clock=clock)
    for _ in range(3):
        serve_one_at_a_time(queue, clock, 100, 0.2, 1)
        serve_one_at_a_time(queue, clock, 1000, 1.1, 1)
    assert queue.cost() == pytest.approx((0.1, 0.001))
    queue.enter(1000)
    assert queue.predicted_wait_s(100) == pytest.approx(0.1 * 2 + 0.001 * 1100)
    assert queue.predicted_wait_s(400, 4) == pytest.approx(0.1 * 5 + 0.001 * 1400)


def test_the_cost_is_not_trusted_before_enough_first_tokens():
    clock = Clock()
    queue = WaitingQueue(clock=clock)
    serve_one_at_a_time(queue, clock, 100, 10.0, MIN_DRAINED - 1)   # slow first requests (warm-up)
    assert queue.predicted_wait_s(100) is None
    serve_one_at_a_time(queue, clock, 100, 10.0, 1)
    assert queue.predicted_wait_s(100) is not None


def test_a_request_gone_before_its_first_token_leaves_the_queue_and_its_time_goes_to_the_next():
    clock = Clock()
    queue = WaitingQueue(window_s=1e9, clock=clock)
    serve_one_at_a_time(queue, clock, 100, 1.0, MIN_DRAINED)
    queue.enter(100)
    clock.now_s += 1.0
    queue.leave(100, first_token=False)
    assert (queue.num_requests, queue.num_tokens, queue.num_drained) == (0, 0, MIN_DRAINED)
    serve_one_at_a_time(queue, clock, 100, 1.0, 1)   # its second of waiting counts before this first token
    assert queue.cost() == pytest.approx((0.0, 6.0 / 500))


def test_the_cost_follows_a_slower_load_within_a_few_windows():
    clock = Clock()
    queue = WaitingQueue(window_s=10.0, clock=clock)
    serve_one_at_a_time(queue, clock, 1000, 1.0, 100)    # 1 ms per token for 100 s
    assert queue.cost()[1] == pytest.approx(0.001)
    serve_one_at_a_time(queue, clock, 1000, 4.0, 20)     # then 4 ms per token for 80 s (8 windows)
    assert queue.cost()[1] == pytest.approx(0.004, rel=0.01)


def test_the_decode_pace_is_seconds_over_tokens_and_unknown_once_streams_go_quiet():
    clock = Clock()
    pace = DecodePace(window_s=5.0, clock=clock)
    pace.num_streams = 2
    pace.add(0.1, MIN_PACED_TOKENS - 1)
    assert pace.seconds_per_token() is None   # too few tokens yet
    pace.add(0.05, 1)                         # a stream's next token 50 ms after its last ...
    pace.add(0.20, 4)                         # ... and one that lagged and caught up with four in one message
    assert pace.seconds_per_token() == pytest.approx(0.35 / (MIN_PACED_TOKENS + 4))
    pace.num_streams = 0                      # both ended: a new stream would run alone
    assert pace.seconds_per_token() is None
    pace.num_streams = 1                      # one still runs, but streamed nothing for a minute
    clock.now_s += 60.0
    assert pace.seconds_per_token() is None
