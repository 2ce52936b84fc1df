"""Real vocabularies for tests, built offline.

Qwen's byte-level BPE: its first 32768 tokens by rank, from Qwen's published `qwen.tiktoken`
(data/qwen_ranks_32k.tiktoken.gz; the 256 single bytes and every merge of a kept token rank
lower, so the prefix is a vocabulary of its own). tiktoken stores only ranks, so the merges
are recovered by running BPE over each token's bytes with the ranks below its own (the last
step that forms the token is its merge).
"""

from __future__ import annotations

import base64
import gzip
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from moechat.engine.text.tokenizer import CONTROL, NORMAL, byte_to_unicode

QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def published_patterns() -> dict[str, str]:
    """tiktoken's own pre-tokenizer regexes for GPT-2 (r50k), cl100k (llama 3's) and o200k (gpt-4o),
    read from tiktoken's source, not from the module under test (the encodings' files are not needed)."""
    import ast
    import inspect

    import tiktoken_ext.openai_public as openai_public

    tree = ast.parse(inspect.getsource(openai_public))
    found: dict[str, str] = {"default": openai_public.r50k_pat_str}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("cl100k_base", "o200k_base")):
        key = "llama-bpe" if fn.name == "cl100k_base" else "gpt-4o"
        for node in ast.walk(fn):
            if isinstance(node, ast.Dict):  # {"pat_str": "..."}
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == "pat_str" and isinstance(v, ast.Constant):
                        found[key] = str(v.value)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.targets:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id == "pat_str":  # "|".join([...])
                    found[key] = "|".join(ast.literal_eval(node.value.args[0]))
    return found


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    ranks: dict[bytes, int]  # the byte tokens, for tiktoken as the reference
    specials: dict[str, int]


@cache
def qwen_ranks() -> dict[bytes, int]:
    path = Path(__file__).parent / "data" / "qwen_ranks_32k.tiktoken.gz"
    ranks: dict[bytes, int] = {}
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    rank = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not reachable by one merge")
    return parts[0], parts[1]


@cache
def qwen_vocab(n_tokens: int | None = None) -> Vocab:
    """The first `n_tokens` Qwen tokens by rank (all if None) plus its three special tokens."""
    all_ranks = qwen_ranks()
    ranks = {b: r for b, r in all_ranks.items() if n_tokens is None or r < n_tokens}
    by_rank = sorted(ranks, key=ranks.__getitem__)
    enc = byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    tokens = [text(b) for b in by_rank]
    merges = []
    for b in by_rank:
        if len(b) > 1:
            left, right = _merge_of(b, ranks)
            merges.append(f"{text(left)} {text(right)}")
    types = [NORMAL] * len(tokens)
    specials = {}
    for s in QWEN_SPECIALS:
        specials[s] = len(tokens)
        tokens.append(s)
        types.append(CONTROL)
    return Vocab(tokens, types, merges, ranks, specials)
