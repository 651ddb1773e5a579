"""engine.fingerprint: the string form round-trips, what is compared, what is refused."""
from __future__ import annotations

import pytest

from engine.fingerprint import SAMPLE_NBYTES, Fingerprint, ModelIdentity, check_peer, weights_digest

IDENTITY = ModelIdentity(1, "LlamaForCausalLM", "00112233445566aa", "ffeeddccbbaa9988", "model.gguf")
PRINT = Fingerprint(IDENTITY, "float32", "2x2x16/16", "0/1")


def test_string_form_round_trips():
    text = str(PRINT)
    assert text == ("proto=1 arch=LlamaForCausalLM config=00112233445566aa weights=ffeeddccbbaa9988 "
                    "name=model.gguf dtype=float32 kv=2x2x16/16 tp=0/1")
    assert Fingerprint.parse(text) == PRINT


@pytest.mark.parametrize("text, message", [
    ("", "not a Tandem model fingerprint"), ("proto=1", "not a Tandem model fingerprint"),
    (str(PRINT) + " extra=1", "not a Tandem model fingerprint"),
    (str(PRINT).replace("proto=1", "proto=x"), "not a Tandem model fingerprint"),
    (str(PRINT) + " " + "x" * 2000, r"a fingerprint of 2129 characters \(at most 1024\)")])
def test_parse_refuses_anything_else(text, message):
    with pytest.raises(ValueError, match=message):
        Fingerprint.parse(text)


def test_mismatch_names_the_fields_that_differ_but_never_the_name():
    renamed = ModelIdentity(1, "LlamaForCausalLM", "00112233445566aa", "ffeeddccbbaa9988", "copy.gguf")
    assert PRINT.mismatch(Fingerprint(renamed, "float32", "2x2x16/16", "0/1")) == []
    assert PRINT.mismatch(Fingerprint(IDENTITY, "bfloat16", "2x2x16/8", "0/2")) == ["dtype", "kv", "tp"]


def test_check_peer_names_both_sides():
    other = str(Fingerprint(IDENTITY, "float32", "2x2x16/8", "0/1"))
    reason = check_peer(str(PRINT), other, "prefill", "decode")
    assert reason == f"model fingerprints differ in kv: decode worker {other} vs prefill worker {PRINT}"
    assert check_peer(str(PRINT), str(PRINT), "prefill", "decode") == ""
    assert "sent no valid model fingerprint" in check_peer(str(PRINT), "", "decode", "prefill")


def test_weights_digest_sees_sampled_bytes_and_size(tmp_path):
    path = tmp_path / "w.safetensors"
    data = bytearray(range(256)) * (SAMPLE_NBYTES // 16)   # 16 samples' worth: every byte is sampled
    path.write_bytes(data)
    before = weights_digest([path])
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    changed = weights_digest([path])
    path.write_bytes(data + b"\0")
    assert len({before, changed, weights_digest([path])}) == 3
