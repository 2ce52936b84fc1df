"""One token id from a step's logits: greedy, or temperature with top-k, min-p and top-p.

Only the top-k candidates can be drawn, so they are found first and the rest of the arithmetic runs on
them: a softmax, sort and cumulative sum over the whole vocabulary (151,936 entries on Qwen3) cost
8.5 ms a token on the CPU, as much as a third of a decode step. On the CPU the candidates come from
numpy: the k largest lie among the elements at or above the k-th largest of the blocks' maxima, a
few more than k found in two passes over the logits, then sorted. On a GPU sampling stays where
the logits are, and only the chosen id crosses to the host.

The draw is the same distribution the whole-vocabulary form gives: softmax of logits / temperature
over the k largest (ties: the lower id first), min-p zeroing the candidates below min_p times the
largest probability, top-p keeping the shortest prefix whose probability reaches top_p (measured
before min-p's zeros are renormalised away), then one draw in proportion to what is left.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .events import SamplingParams

BLOCK = 128  # logits a block when looking for the top k: a block's maximum is one pass of vector compares


def top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest of x [V] (all of them for k = 0 or k >= V), largest first; ties: the lower id
    first."""
    n = x.shape[0]
    blocks = n // BLOCK
    if k <= 0 or k >= n or blocks <= k:
        return np.argsort(-x, kind="stable")[: k if k > 0 else n]
    maxima = x[: blocks * BLOCK].reshape(blocks, BLOCK).max(axis=1)  # [blocks]
    if blocks * BLOCK < n:
        maxima = np.append(maxima, x[blocks * BLOCK :].max())
    # The k blocks with the largest maxima hold k elements at or above the k-th largest maximum, so the
    # k largest elements are all at or above it.
    floor = np.partition(maxima, maxima.shape[0] - k)[maxima.shape[0] - k]
    candidates = np.flatnonzero(x >= floor)  # ascending ids: the stable sort keeps ties in id order
    return candidates[np.argsort(-x[candidates], kind="stable")[:k]]


def _penalized(logits: torch.Tensor, p: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """The logits with the repeat penalty on the recent tokens (a copy; the logits themselves untouched)."""
    if p.repeat_penalty == 1.0 or not history:
        return logits
    logits = logits.clone()
    recent = torch.tensor(sorted(set(history[-p.repeat_last_n :])), dtype=torch.long, device=logits.device)
    vals = logits[recent]
    logits[recent] = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    return logits


def _kept(probs: np.ndarray | torch.Tensor, p: SamplingParams) -> None:
    """min-p and top-p on the candidates' probabilities [k] (largest first, summing to 1), in place."""
    if p.min_p > 0:
        probs[probs < p.min_p * probs[0]] = 0
    if p.top_p < 1:
        cum = probs.cumsum(0)
        probs[cum - probs > p.top_p] = 0  # keep the shortest prefix reaching top_p


def sample(logits: torch.Tensor, p: SamplingParams, history: Sequence[int], gen: torch.Generator) -> int:
    """One token id from logits [V] under the sampling parameters (greedy at temperature 0); `gen` is a
    generator on the logits' device."""
    logits = _penalized(logits.float(), p, history)
    if logits.device.type != "cpu":
        return _sample_on_device(logits, p, gen)
    x = logits.numpy()
    if p.temperature <= 0:
        return int(x.argmax())
    ids = top_ids(x, p.top_k) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0 else np.arange(x.shape[0])
    scaled = x[ids].astype(np.float64) / p.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    _kept(probs, p)
    cum = np.cumsum(probs)
    u = float(torch.rand((), generator=gen, dtype=torch.float64)) * cum[-1]
    return int(ids[min(int(np.searchsorted(cum, u, side="right")), ids.shape[0] - 1)])


def _sample_on_device(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    if p.temperature <= 0:
        return int(logits.argmax())
    if p.top_k > 0:
        vals, ids = torch.topk(logits, min(p.top_k, logits.numel()))  # [k] each, largest first
    else:
        vals, ids = torch.sort(logits, descending=True, stable=True)
    probs = torch.softmax(vals.double() / p.temperature, dim=-1)
    _kept(probs, p)
    return int(ids[torch.multinomial(probs / probs.sum(), 1, generator=gen)])
