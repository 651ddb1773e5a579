"""Sampling checks have one home (engine.config.check_sampling): the router's prepare_sampling and
the engine's SamplingParams refuse the same values with the same message, and clamp the same."""
from __future__ import annotations

import pytest

from engine.config import SamplingParams
from protos.tandem.v1 import tandem_pb2
from router.__main__ import parse_args
from router.config import RouterConfig
from router.errors import RouterError
from router.sampling import prepare_sampling

MIN_TEMPERATURE = 0.01   # vLLM's floor (engine.config.MIN_TEMPERATURE)
# Values one side took and the other refused until both called engine.config.check_sampling (the
# values both already refused alike are in tests/engine/test_loader.py and tests/workers/test_malformed.py).
BAD = [("temperature", float("inf")), ("temperature", 1e300), ("repetition_penalty", 1e-40),
       ("repetition_penalty", 1e9)]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v}" for f, v in BAD])
def test_router_and_engine_refuse_the_same_values_with_the_same_message(field, value):
    with pytest.raises(ValueError, match=f"^{field} must") as engine_error:
        SamplingParams(**{field: value})
    with pytest.raises(RouterError, match=f"^{field} must") as router_error:
        prepare_sampling(tandem_pb2.Sampling(**{field: value}), 4, 256, 16)
    assert router_error.value.http_status == 400 and router_error.value.param == field
    # The proto field is float32: compare what both saw for the same stored value.
    assert router_error.value.message.split(", got")[0] == str(engine_error.value).split(", got")[0]


def test_stop_token_ids_beyond_the_vocabulary_or_too_many_are_refused_by_both():
    with pytest.raises(RouterError, match=r"stop_token_ids must be token ids in \[0, 100\), got 100") as info:
        prepare_sampling(tandem_pb2.Sampling(stop_token_ids=[5, 100]), 4, 256, 16, vocab_size=100)
    assert info.value.param == "stop_token_ids"
    with pytest.raises(ValueError, match="^stop_token_ids must hold at most 128 ids, got 129"):
        SamplingParams(stop_token_ids=range(129))
    with pytest.raises(ValueError, match=rf"^stop_token_ids must be token ids in \[0, {2**63}\), got -1"):
        SamplingParams(stop_token_ids=(-1,))


@pytest.mark.parametrize("temperature", [1e-40, 1e-7, 0.009])
def test_tiny_positive_temperature_is_raised_to_the_minimum_like_vllm(temperature):
    assert SamplingParams(temperature=temperature).temperature == MIN_TEMPERATURE
    params = prepare_sampling(tandem_pb2.Sampling(temperature=temperature), 4, 256, 16).params
    assert params.temperature == pytest.approx(MIN_TEMPERATURE)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.5).temperature == 0.5


def test_request_limits_are_config_fields_with_cli_flags():
    config = parse_args(["--max-sub-requests", "4", "--max-prompt-chars", "1000", "--max-request-body-bytes",
                         "2048", "--max-waiting", "9", "--allowed-hosts", "LocalHost, api.example.com:8000"])
    assert (config.max_sub_requests, config.max_prompt_chars, config.max_request_body_bytes, config.max_waiting) \
        == (4, 1000, 2048, 9)
    assert config.allowed_hosts == ("localhost", "api.example.com:8000")
    assert RouterConfig().allowed_hosts == ()
    for field in ("max_sub_requests", "max_prompt_chars", "max_request_body_bytes"):
        with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
            RouterConfig(**{field: 0})
