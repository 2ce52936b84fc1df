"""Routing replayed from a recorded trace, for benchmarks only: real routing on a model with random weights.

The generated big models (`shared/tools/big-moe`) route a token to few experts over and over, so a
tier that holds a few of them hits nearly always; trained models route broadly. `ReplayedRouting`
wraps a model's expert executor and hands it, for each token and MoE layer, the experts a recorded
trace chose (another engine's route_trace v1 CSV, or moechat's own `--moe-cache-trace`) in place of
the router's, so the tiers see real routing's reuse and misses. The text it produces is not the
model's: `moechat run --bench-replay-routing` is the only way in, and the server and the chat app
have no such flag.

Mapping: token t takes the trace's token t (cycling through the recorded tokens, prompt and decode
in order); model layer i takes the trace's i-th MoE layer modulo their count; expert ids beyond the
model's count wrap around; where the model selects more experts per token than the trace, the rest
come from the trace's next layer at the same token (ids not already chosen), so that each expert a
token reads is one a trained router chose somewhere. The router's weights are kept.

Look-ahead: the model's router would predict for its own random routing, not the trace's, so by default
a replay reads on demand only. `recall` > 0 emulates a predictor instead: the prediction for a layer is
the trace's own choice with each expert kept at that rate and otherwise swapped for another (a seeded
draw), the rate a bench states as measured on a real router (the engine reports its recall).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..moe.host_experts import ExpertExecutor, TokenAhead
from ..moe.kernel_calls import TokenCall
from .route_csv import is_route_csv, read_route_csv
from .trace import read_trace

Token = dict[int, tuple[int, ...]]  # trace layer -> the experts it chose for one token


def trace_tokens(path: str | Path) -> tuple[list[Token], int]:
    """Each recorded token's experts per layer, in order, and the trace's experts per layer (`n_expert`,
    the largest id + 1 where the trace does not say). ValueError for a file that is neither kind."""
    tokens: list[Token] = []
    if is_route_csv(path):
        rt = read_route_csv(path)
        by_step: dict[tuple[int, int, int], Token] = {}  # a prompt may be recorded layer by layer
        for step, (layer, _, ids) in zip(rt.steps, rt.records, strict=True):
            by_step.setdefault(step, {})[layer] = ids
        return list(by_step.values()), max(bank[1] for bank in rt.banks)
    try:
        tr = read_trace(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    records = [(r.layer, r.n_used, r.ids) for r in tr.records if r.layer >= 0]  # (prefetch records are < 0)
    n_expert = 1 + max((max(ids) for _, _, ids in records if ids), default=0)
    # A token starts where a layer comes again (moechat looks a token's layers up in order); a batch record
    # (a prompt) holds several tokens' rows.
    pending: list[Token] = []
    for layer, n_used, ids in records:
        rows = [tuple(ids[j : j + n_used]) for j in range(0, len(ids), n_used)]
        if not pending or layer in pending[0] or len(rows) != len(pending):
            tokens += pending
            pending = [{} for _ in rows]
        for tok, row in zip(pending, rows, strict=True):
            tok[layer] = row
    tokens += pending
    if not tokens:
        raise ValueError(f"{path}: no routing in the trace")
    return tokens, n_expert


class ReplayedRouting:
    """An `ExpertExecutor` that runs `inner` on the trace's experts instead of the router's."""

    def __init__(self, inner: ExpertExecutor, path: str | Path, moe_layers: Sequence[int], n_expert: int,
                 recall: float = 0.0) -> None:  # fmt: skip
        if not 0.0 <= recall <= 1.0:
            raise ValueError(f"the emulated prediction's recall must be in [0, 1], got {recall}")
        self.inner = inner
        self.recall = recall
        self._rng = np.random.default_rng(0)
        self.tokens, self.trace_n_expert = trace_tokens(path)
        self.trace_layers = sorted({layer for tok in self.tokens for layer in tok})
        # Model layer -> the position of its trace layer in trace_layers.
        self.at = {m: i % len(self.trace_layers) for i, m in enumerate(sorted(moe_layers))}
        self.n_expert = n_expert
        self.first_layer = min(moe_layers)
        # The router's predictions are not the trace's: look-ahead only with an emulated predictor.
        self.prefetch_tokens = inner.prefetch_tokens if recall > 0 else 0
        self.position = 0  # tokens seen

    def token_call(self, layer: int) -> TokenCall | None:
        return None  # every layer calls through here

    def account(self, layers: Sequence[int], ids: Sequence[np.ndarray], ahead: TokenAhead | None = None) -> None:
        """Nothing owed: no token call was given out."""

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n_tokens, k = ids.shape
        if layer == self.first_layer:
            self.position += n_tokens
        start = self.position - n_tokens
        rows = [self._row(layer, start + t, k) for t in range(n_tokens)]
        return self.inner(layer, x, torch.tensor(rows, dtype=ids.dtype, device=ids.device), weights)

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        """The emulated prediction of `layer`'s experts for the tokens of this step (ids: the router's, unused)."""
        n_tokens, k = ids.shape
        # The prediction comes before the lookup of the layer before it: the step's tokens are counted already
        # unless that layer is the step's first.
        start = self.position if layer - 1 == self.first_layer else self.position - n_tokens
        rows = []
        for t in range(n_tokens):
            row = self._row(layer, start + t, k)
            for j in range(k):
                if self._rng.random() >= self.recall:  # a miss of the predictor: some other expert
                    others = [e for e in range(self.n_expert) if e not in row]
                    row[j] = others[int(self._rng.integers(len(others)))]
            rows.append(row)
        self.inner.prefetch(layer, torch.tensor(rows, dtype=ids.dtype))

    def _row(self, layer: int, t: int, k: int) -> list[int]:
        tok = self.tokens[t % len(self.tokens)]
        at = self.at[layer]
        row: list[int] = []
        for j in range(len(self.trace_layers)):  # this layer's choice, then the next layers' for the rest
            for e in tok.get(self.trace_layers[(at + j) % len(self.trace_layers)], ()):
                e %= self.n_expert
                if e not in row:
                    row.append(e)
                if len(row) == k:
                    return row
        e = 0
        while len(row) < k:  # (a trace with fewer distinct experts per token than the model selects)
            if e not in row:
                row.append(e)
            e += 1
        return row
