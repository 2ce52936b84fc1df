"""Tokenizers built from GGUF metadata, behaving as llama.cpp's do.

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with merges. The pre-tokenizer regex is
  chosen by `tokenizer.ggml.pre`; the merging itself runs in the `tokenizers` library.
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE that merges the adjacent pair
  with the best score, with byte fallback (Gemma, Mixtral).

Special tokens are split out of the text before either model sees it: user-defined tokens
always, control tokens only when the caller asks for `parse_special` (rendered templates do,
user text does not).
"""

from __future__ import annotations

import codecs
import heapq
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..gguf.reader import GGUFError

logger = logging.getLogger(__name__)

# tokenizer.ggml.token_type values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes (applied in sequence) by `tokenizer.ggml.pre`.
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_O200K = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "olmo": (_GPT2,),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "gpt-4o": (_O200K,),
    "smollm": (r"\p{N}", _GPT2),  # digits one by one, then GPT-2's rule (llama.cpp groups it with starcoder)
}
# llama.cpp takes a whole pre-token as one token when the vocabulary has it (llama 3 only).
_IGNORE_MERGES = {"llama-bpe", "llama3"}
# Control tokens that end a turn even when the metadata names only EOS.
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|return|>",
    "<|call|>", "<|eom_id|>", "</s>", "<eos>",
}  # fmt: skip


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


class TokenizerError(GGUFError):
    """Tokenizer metadata that cannot be used."""


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    eot: int | None
    unk: int | None
    pad: int | None
    eog: frozenset[int]


class _SpecialSplitter:
    """Splits text into plain fragments and special-token ids, leftmost-longest."""

    def __init__(self, specials: Mapping[str, int]) -> None:
        self.trie: dict[str, Any] = {}
        for text, tid in specials.items():
            if not text:
                continue
            node = self.trie
            for ch in text:
                node = node.setdefault(ch, {})
            node.setdefault("", tid)  # "" marks the end of a token; first id wins

    def split(self, text: str) -> list[str | int]:
        out: list[str | int] = []
        start = i = 0
        n = len(text)
        while i < n:
            node = self.trie.get(text[i])
            best: tuple[int, int] | None = None
            j = i + 1
            while node is not None:
                if "" in node:
                    best = (j, node[""])
                if j >= n:
                    break
                node = node.get(text[j])
                j += 1
            if best is None:
                i += 1
                continue
            if start < i:
                out.append(text[start:i])
            out.append(best[1])
            start = i = best[0]
        if start < n:
            out.append(text[start:])
        return out


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        types: Sequence[int],
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        pre: str = "default",
        special: SpecialIds,
        add_bos: bool,
        add_eos: bool = False,
        add_space_prefix: bool = False,
    ) -> None:
        self.model = model
        self.tokens = list(tokens)
        self.types = [int(t) for t in types]
        self.special = special
        self.add_bos = add_bos and special.bos is not None
        self.add_eos = add_eos and special.eos is not None
        self.add_space_prefix = add_space_prefix
        self.pre = pre
        self._ids: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self._ids.setdefault(t, i)
        user = {t: i for i, t in enumerate(self.tokens) if self.types[i] == USER_DEFINED}
        control = {t: i for i, t in enumerate(self.tokens) if self.types[i] in (CONTROL, USER_DEFINED)}
        self._user_splitter = _SpecialSplitter(user)
        self._all_splitter = _SpecialSplitter(control)
        if model == "gpt2":
            self._bpe = _build_byte_bpe(self.tokens, merges or [], pre)
        elif model == "llama":
            self._scores = [float(s) for s in (scores if scores is not None else [0.0] * len(self.tokens))]
            self._byte_ids = {}
            for i, t in enumerate(self.tokens):
                if self.types[i] == BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                    self._byte_ids[int(t[3:5], 16)] = i
        else:
            raise TokenizerError(f"unsupported tokenizer model '{model}' (supported: gpt2, llama)")

    # -- construction from metadata ------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "model") -> Tokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{source}: key tokenizer.ggml.model: missing (the file has no tokenizer)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError(f"{source}: key tokenizer.ggml.tokens: missing or not an array of strings")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = [NORMAL] * n if types is None else [int(t) for t in types]
        if len(types) != n:
            raise TokenizerError(f"{source}: key tokenizer.ggml.token_type: {len(types)} entries for {n} tokens")
        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) != n:
            raise TokenizerError(f"{source}: key tokenizer.ggml.scores: {len(scores)} entries for {n} tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if model == "gpt2" and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
            raise TokenizerError(f"{source}: key tokenizer.ggml.merges: missing or not an array of strings")

        def tid(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}_token_id")
            if v is None:
                return None
            if not 0 <= int(v) < n:
                raise TokenizerError(f"{source}: key tokenizer.ggml.{key}_token_id: {v} outside the {n} tokens")
            return int(v)

        bos, eos, eot, eom, unk, pad = (tid(k) for k in ("bos", "eos", "eot", "eom", "unknown", "padding"))
        eog = {i for i in (eos, eot, eom) if i is not None}
        eog |= {i for i, t in enumerate(tokens) if types[i] == CONTROL and t in _EOG_TEXTS}
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        return cls(
            model=str(model),
            tokens=tokens,
            types=types,
            scores=scores,
            merges=merges,
            pre=pre,
            special=SpecialIds(bos, eos, eot, unk, pad, frozenset(eog)),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        )

    # -- encoding --------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; BOS/EOS per the model's flags when `add_special`."""
        splitter = self._all_splitter if parse_special else self._user_splitter
        out: list[int] = []
        if add_special and self.add_bos and self.special.bos is not None:
            out.append(self.special.bos)
        prev_special = True
        for frag in splitter.split(text):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "gpt2":
                out.extend(self._bpe.encode(frag, add_special_tokens=False).ids)
            else:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm_encode(frag.replace(" ", "▁")))
            prev_special = False
        if add_special and self.add_eos and self.special.eos is not None:
            out.append(self.special.eos)
        return out

    def _spm_encode(self, text: str) -> list[int]:
        # Merge the adjacent pair whose union has the best score (leftmost on ties) until none is a token.
        piece: list[str | None] = list(text)
        n = len(piece)
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, str]] = []
        ids, scores = self._ids, self._scores

        def push(left: int) -> None:
            right = nxt[left]
            if left < 0 or right < 0:
                return
            merged = f"{piece[left]}{piece[right]}"
            tid = ids.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = nxt[left]
            if piece[left] is None or right < 0 or f"{piece[left]}{piece[right]}" != merged:
                continue  # stale: one side changed since this pair was pushed
            piece[left], piece[right] = merged, None
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left])
            push(left)
        out: list[int] = []
        for p in piece:
            if p is None:
                continue
            tid = ids.get(p)
            if tid is not None:
                out.append(tid)
                continue
            for byte in p.encode("utf-8"):
                bid = self._byte_ids.get(byte, self.special.unk)
                if bid is not None:
                    out.append(bid)
        return out

    # -- decoding --------------------------------------------------------------------------

    def token_bytes(self, tid: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for (control tokens: empty unless `special`)."""
        if not 0 <= tid < len(self.tokens):
            raise IndexError(f"token id {tid} outside the vocabulary of {len(self.tokens)}")
        text, kind = self.tokens[tid], self.types[tid]
        if kind in (CONTROL, UNUSED):
            return text.encode("utf-8") if special else b""
        if kind == USER_DEFINED:
            return text.encode("utf-8")
        if self.model == "gpt2":
            table = unicode_to_byte()
            return bytes(table[c] for c in text) if all(c in table for c in text) else text.encode("utf-8")
        if kind == BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        return text.replace("▁", " ").encode("utf-8")

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        dec = self.stream_decoder(special=special)
        return "".join(dec.push(t) for t in ids) + dec.flush()

    def stream_decoder(self, *, special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, special=special)

    def is_eog(self, tid: int) -> bool:
        return tid in self.special.eog


class StreamDecoder:
    """Turns token ids into text one at a time, never emitting half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SentencePiece prompts start with an added space that is not part of the text.
        self._strip_space = tokenizer.model == "llama" and tokenizer.add_space_prefix
        self._started = False

    def push(self, tid: int) -> str:
        data = self._tok.token_bytes(tid, special=self._special)
        if self._strip_space and not self._started and data:
            data = data.removeprefix(b" ")
        if data:
            self._started = True
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _build_byte_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str) -> Any:
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if pre not in PRE_TOKENIZERS:
        logger.warning("unknown pre-tokenizer '%s': using the GPT-2 default", pre)
    patterns = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"key tokenizer.ggml.merges: entry {m!r} is not two tokens")
        pairs.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES)
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tok
