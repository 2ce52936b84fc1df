"""Tokenizers from GGUF metadata against references we did not write: tiktoken and transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moechat.engine.gguf.reader import GGUFFile
from moechat.engine.text.tokenizer import Tokenizer, TokenizerError
from testkit.vocab import QWEN_PATTERN, Vocab, published_patterns, qwen_vocab

MULTILINGUAL = (
    "Hello world! The quick brown fox jumps over the lazy dog. It's 2026, isn't it?\n"
    "naïve café — déjà vu; Straße, Ærø, İstanbul. 東京は晴れです。北京欢迎你！ 안녕하세요 세계.\n"
    "Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया. สวัสดีชาวโลก\n"
    "Emoji: 🤖🎉👩‍👩‍👧‍👦🇯🇵  tabs\tand   runs of    spaces\n\n\ncode: def f(x): return x**2 + 1_000_000\n"
    "numbers 1234567890 3.14159 -42e-3 ... ???!!! <html><b>bold</b></html> ‘quotes’ “double”"
)


def _qwen_meta(v: Vocab) -> dict[str, Any]:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": v.tokens,
        "tokenizer.ggml.token_type": v.types,
        "tokenizer.ggml.merges": v.merges,
        "tokenizer.ggml.bos_token_id": v.specials["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": v.specials["<|im_end|>"],
        "tokenizer.ggml.add_bos_token": False,
    }


def _tiktoken(v: Vocab) -> Any:
    import tiktoken

    return tiktoken.Encoding("qwen-ref", pat_str=QWEN_PATTERN, mergeable_ranks=v.ranks, special_tokens=v.specials)


@pytest.fixture(scope="module")
def qwen() -> tuple[Tokenizer, Any]:
    v = qwen_vocab()
    return Tokenizer.from_metadata(_qwen_meta(v)), _tiktoken(v)


def test_qwen_bpe_matches_tiktoken(qwen: tuple[Tokenizer, Any]) -> None:
    tok, ref = qwen
    ids = tok.encode(MULTILINGUAL)
    assert ids == ref.encode_ordinary(MULTILINGUAL)
    assert len(ids) > 150
    assert tok.decode(ids) == MULTILINGUAL


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_qwen_bpe_matches_tiktoken_on_any_text(qwen: tuple[Tokenizer, Any], text: str) -> None:
    tok, ref = qwen
    # Lone surrogates cannot be encoded as UTF-8 by either side.
    text = text.encode("utf-8", "replace").decode("utf-8")
    ids = tok.encode(text)
    assert ids == ref.encode_ordinary(text)
    assert tok.decode(ids) == text


def test_qwen_special_tokens_only_when_asked(qwen: tuple[Tokenizer, Any]) -> None:
    tok, ref = qwen
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = tok.encode(text, parse_special=True)
    assert parsed == ref.encode(text, allowed_special="all")
    start, end = qwen_vocab().specials["<|im_start|>"], qwen_vocab().specials["<|im_end|>"]
    assert parsed[0] == start and parsed[-1] == end
    plain = tok.encode(text)
    assert start not in plain and plain == ref.encode_ordinary(text)
    assert tok.is_eog(end) and not tok.is_eog(start)
    assert tok.decode(parsed) == "user\nhi" and tok.decode(parsed, special=True) == text


def test_tokenizer_from_a_gguf_file_with_a_truncated_vocabulary(tiny_model: Path) -> None:
    with GGUFFile(tiny_model) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    ref = _tiktoken(qwen_vocab(1024))
    assert tok.n_vocab == 1027
    assert tok.encode(MULTILINGUAL) == ref.encode_ordinary(MULTILINGUAL)
    assert tok.decode(tok.encode(MULTILINGUAL)) == MULTILINGUAL


@pytest.fixture(scope="module")
def gemma(gemma_gguf: Path, test_cache: Path) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    with GGUFFile(gemma_gguf) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    # transformers converts the GGUF vocabulary itself (about 30 s): keep its result between runs.
    saved = test_cache / "gemma3-reference-tokenizer"
    if not (saved / "tokenizer.json").exists():
        ref = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
        ref.save_pretrained(saved)
    return tok, AutoTokenizer.from_pretrained(saved)


@pytest.mark.slow
def test_gemma_spm_matches_transformers(gemma: tuple[Tokenizer, Any]) -> None:
    tok, ref = gemma
    text = MULTILINGUAL + " <start_of_turn>user\nhello<end_of_turn>"
    ids = tok.encode(text, parse_special=True)
    assert ids == ref(text)["input_ids"]
    assert ids[0] == 2  # BOS, as the metadata asks
    assert tok.encode(text, add_special=False, parse_special=True) == ids[1:]
    assert tok.decode(tok.encode(MULTILINGUAL)) == MULTILINGUAL


@pytest.mark.slow  # its fixture loads transformers' Gemma tokenizer
@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_gemma_spm_matches_transformers_on_any_text(gemma: tuple[Tokenizer, Any], text: str) -> None:
    tok, ref = gemma
    ids = tok.encode(text, parse_special=True)
    assert ids == ref(text)["input_ids"]


@pytest.mark.slow
def test_gemma_byte_fallback_and_control_tokens(gemma: tuple[Tokenizer, Any]) -> None:
    tok, _ = gemma
    # Rare CJK extension characters: those the vocabulary lacks become their UTF-8 bytes.
    rare = [chr(c) for c in range(0x2B740, 0x2B81D)]
    fallback = [ch for ch in rare if len(tok.encode(ch, add_special=False)) == 4]
    assert len(fallback) > 10
    text = "".join(fallback[:3])
    ids = tok.encode(text, add_special=False)
    assert len(ids) == 12 and all(tok.tokens[i].startswith("<0x") for i in ids)
    assert tok.decode(ids) == text
    assert tok.is_eog(1) and tok.decode([2, 1]) == ""


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_stream_decoding_never_emits_half_a_character(
    which: str, qwen: tuple[Tokenizer, Any], gemma: tuple[Tokenizer, Any]
) -> None:
    tok = (qwen if which == "qwen" else gemma)[0]
    text = "東京 🤖🎉👩‍👩‍👧‍👦 \U0002b740 naïve"
    ids = tok.encode(text, add_special=False)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Some token ends inside a character: the decoder held those bytes back.
    assert any(p == "" and tok.token_bytes(i) for p, i in zip(pieces, ids, strict=False))


def test_bad_tokenizer_metadata() -> None:
    v = qwen_vocab(300)
    meta = _qwen_meta(v)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model: missing"):
        Tokenizer.from_metadata({k: x for k, x in meta.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(TokenizerError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="eos_token_id: 99999 outside"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.eos_token_id": 99999})
    with pytest.raises(TokenizerError, match="token_type: 2 entries"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(TokenizerError, match="merges: missing"):
        Tokenizer.from_metadata({k: x for k, x in meta.items() if k != "tokenizer.ggml.merges"})


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-4o", "default"])
def test_other_pre_tokenizers_match_tiktoken_with_the_same_regex(pre: str) -> None:
    import tiktoken

    v = qwen_vocab()
    tok = Tokenizer.from_metadata({**_qwen_meta(v), "tokenizer.ggml.pre": pre})
    pattern = published_patterns()[pre]  # tiktoken's own regex, not ours
    ref = tiktoken.Encoding(f"ref-{pre}", pat_str=pattern, mergeable_ranks=v.ranks, special_tokens=v.specials)
    text = MULTILINGUAL + " CamelCaseWords HTTPServer className onClick 12345678 don't I'M"
    ids = tok.encode(text)
    assert ids == ref.encode_ordinary(text)
    # The choice of regex shows: the same vocabulary splits this text differently under qwen2's
    # (llama-bpe differs from qwen2 only in digit runs, which Qwen's vocabulary splits anyway).
    if pre != "llama-bpe":
        assert ids != Tokenizer.from_metadata(_qwen_meta(v)).encode(text)


def test_smollm_pre_tokenizer_splits_digits(smollm2_gguf: Path) -> None:
    # SmolLM2's `smollm` pre-tokenizer puts every digit in a piece of its own before GPT-2's rule
    # (as llama.cpp does; checked against llama.cpp on prose, numbers and whitespace).
    with GGUFFile(smollm2_gguf) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    ids = tok.encode("I counted 12345 apples.", add_special=False)
    assert [tok.decode([i]) for i in ids] == ["I", " counted", " ", "1", "2", "3", "4", "5", " apples", "."]
    text = "<|im_start|>user\nHi 42 times<|im_end|>\n"
    special = tok.encode(text, add_special=False, parse_special=True)
    assert special[0] == tok.tokens.index("<|im_start|>") and tok.decode(special) == "user\nHi 42 times\n"
    assert tok.is_eog(tok.tokens.index("<|im_end|>"))
