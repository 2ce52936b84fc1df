"""The quality bar for a fast kernel mode: perplexity on real text and KL to the exact path.

A mode's kernels round the activations (int16 or int8) where the exact path multiplies floats; what
users feel of that is the model's predictions on real text. Over the tokens of `TEXT` (chapters I
and II of *Alice's Adventures in Wonderland*, Lewis Carroll, 1865: public domain, from Project
Gutenberg's EBook #11, its header and licence removed), each mode's next-token log-probabilities
are compared with the exact path's: perplexity, mean KL(exact || mode) and top-1 agreement.

The exact path runs the text in windows of `WINDOW` tokens; a mode runs it `CHUNK` tokens per call,
fewer than a prompt's (codes.GEMM_TOKENS), so every token goes through the kernels decode uses,
with its result what decoding it alone would give (the kernels' own guarantee).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TEXT_PATH = Path(__file__).parent / "data" / "alice_ch1_2.txt"
TOKENS = 2048  # compared per model: the test's and the bench's count, so their figures compare
WINDOW = 256  # positions compared at a time: a window of every mode's logits is in memory at once
CHUNK = 8  # tokens per call of a mode under test (decode's kernels)


def text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


def token_ids(model: object, n: int) -> list[int]:
    """The first n tokens of the text as the model's tokenizer gives them (BOS as the model asks)."""
    ids: list[int] = model.tokenizer.encode(text())  # type: ignore[attr-defined]
    if len(ids) < n:
        raise ValueError(f"the text has {len(ids)} tokens for this tokenizer, fewer than {n}")
    return ids[:n]


def windows(model: object, ids: list[int], chunk: int) -> Iterator[torch.Tensor]:
    """Log-probabilities [<= WINDOW, V] (float64 tensors) of `model` (a LoadedModel) at every position of ids,
    a window at a time, the tokens run `chunk` per call through one KV cache."""
    cache = model.new_cache()  # type: ignore[attr-defined]
    with torch.inference_mode():
        for w0 in range(0, len(ids), WINDOW):
            rows = []
            for c0 in range(w0, min(len(ids), w0 + WINDOW), chunk):
                part = ids[c0 : min(c0 + chunk, w0 + WINDOW, len(ids))]
                rows.append(model.model(torch.tensor(part), c0, cache))  # type: ignore[attr-defined]
            yield torch.log_softmax(torch.cat(rows), dim=-1, dtype=torch.float64)


@dataclass(frozen=True)
class Quality:
    """One mode against the exact path over the same tokens."""

    tokens: int
    perplexity: float  # the mode's, on the text's next tokens
    exact_perplexity: float
    kl: float  # mean over positions of KL(exact || mode)
    top1: float  # share of positions where both pick the same top token

    @property
    def perplexity_change(self) -> float:
        """The mode's perplexity relative to the exact path's, less one (0.01: 1% higher)."""
        return self.perplexity / self.exact_perplexity - 1


def compare(
    exact: Iterator[torch.Tensor], modes: dict[str, Iterator[torch.Tensor]], ids: list[int]
) -> dict[str, Quality]:
    """Streams of windows of log-probabilities over the same ids, the exact path's and each mode's,
    read in step (one window of each in memory) -> each mode's Quality."""
    names = list(modes)
    nll_exact = 0.0
    nll = dict.fromkeys(names, 0.0)
    kl = dict.fromkeys(names, 0.0)
    agree = dict.fromkeys(names, 0)
    seen = 0
    for w0, (lp, *lqs) in enumerate(zip(exact, *modes.values(), strict=True)):
        start = w0 * WINDOW
        nxt = torch.tensor(ids[start + 1 : start + 1 + lp.shape[0]])  # the next tokens (none after the last)
        at = torch.arange(nxt.shape[0])
        nll_exact -= float(lp[at, nxt].sum())
        p = lp.exp()
        top = lp.argmax(-1)
        part = torch.empty_like(lp)  # p * (lp - lq), in place: a window of a 262k vocabulary is 0.5 GB
        for name, lq in zip(names, lqs, strict=True):
            kl[name] += float(torch.sub(lp, lq, out=part).mul_(p).sum())
            agree[name] += int((top == lq.argmax(-1)).sum())
            nll[name] -= float(lq[at, nxt].sum())
        seen += lp.shape[0]
    n_next = len(ids) - 1
    ppl_exact = float(np.exp(nll_exact / n_next))
    return {n: Quality(seen, float(np.exp(nll[n] / n_next)), ppl_exact, kl[n] / seen, agree[n] / seen) for n in names}


def array_windows(logits: np.ndarray) -> Iterator[torch.Tensor]:
    """Windows of log-probabilities (float64) from logits [N, V] computed elsewhere (llama.cpp's)."""
    for w0 in range(0, logits.shape[0], WINDOW):
        yield torch.log_softmax(torch.from_numpy(logits[w0 : w0 + WINDOW]), dim=-1, dtype=torch.float64)
