"""Incremental detokenization with stop strings: nothing of a stop string is ever released."""
from __future__ import annotations

from router.text_stream import TextStream


def feed(tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, stop)
    out = []
    for token in ids:
        out.append(stream.add([token]))
        if stream.stopped:
            return out, True
    out.append(stream.finish())
    return out, False


def test_without_stop_strings_text_round_trips(tokenizer):
    parts, stopped = feed(tokenizer, "Hello world, this is Tandem.", [])
    assert "".join(parts) == "Hello world, this is Tandem." and not stopped


def test_stop_string_cuts_the_text_before_it(tokenizer):
    parts, stopped = feed(tokenizer, "Hello world, this is Tandem.", ["this is"])
    assert stopped and "".join(parts) == "Hello world, "


def test_partial_stop_is_held_back_then_released(tokenizer):
    parts, stopped = feed(tokenizer, "one two three", ["two four"])
    assert not stopped and "".join(parts) == "one two three"
    assert not any(p.endswith(" two") for p in parts[:-1])  # " two" waited until it could not be a stop


def test_earliest_of_several_stop_strings_wins(tokenizer):
    parts, stopped = feed(tokenizer, "alpha beta gamma delta", ["delta", "beta"])
    assert stopped and "".join(parts) == "alpha "
