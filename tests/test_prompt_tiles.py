"""A prompt's expert products in tiles (engine/kernels/qtiles.py): the same bits as one token at a time.

The tiles unpack a super-block type's rows once and multiply them with four tokens at a time;
a token whose expert met fewer tokens, or a row left over after the tiles, takes `dot_row`. Both
must give a token the very same float32, so what else is in the prompt never changes its result.
"""

from __future__ import annotations

import numpy as np
import pytest
from moechat.engine.kernels import cpu as cpu_kernels
from moechat.engine.kernels.codes import ACT_SILU
from moechat.engine.kernels.cpu import TOKEN_BLOCK
from moechat.engine.kernels.qtiles import TILE_TOKENS, tiled
from testkit.ggufgen import Q, quantized

TILED = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]


def _selection(ids: np.ndarray) -> tuple[np.ndarray, ...]:
    return cpu_kernels.selection(ids, np.zeros(0, np.int64))


def test_the_super_block_types_take_the_tiles() -> None:
    assert all(tiled(t) for t in TILED)
    assert not any(tiled(t) for t in (Q.Q4_0, Q.Q8_0, Q.MXFP4, Q.F32))


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
def test_a_token_gets_the_same_bits_however_many_share_its_expert(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    n_expert, rows, k, per_token = 5, 37, 512, 2  # 37 rows: a row left over after the tiles of two
    w = quantized((n_expert, rows, k), qtype, rng)
    # Expert 0 meets 9 tokens (two tiles of four and one overlapping), 1 meets 4 (one tile), 2
    # meets 3 (no tile), 3 meets 5; expert 4 only the last token.
    ids = np.array([[0, 1], [0, 3], [0, 1], [0, 3], [0, 2], [0, 3], [0, 2], [0, 1], [0, 2], [1, 3], [4, 3]], np.int64)
    t = ids.shape[0]
    assert list(np.bincount(ids.ravel())) == [2 * TILE_TOKENS + 1, TILE_TOKENS, TILE_TOKENS - 1, 5, 1]
    x = (rng.standard_normal((t, k)) * 10.0 ** rng.integers(-1, 2, (t, 1))).astype(np.float32)
    scale = rng.random(t * per_token).astype(np.float32)
    bias = rng.standard_normal((n_expert, rows)).astype(np.float32)

    def products(ids: np.ndarray, x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a, eids, ptr, a_in, x_rows = _selection(ids)
        out = np.full((ids.size, rows), np.nan, np.float32)
        cpu_kernels.matmul(w, qtype, x, x_rows, eids, eids, ptr, a_in, a, out, scale=scale, bias=bias)
        h = np.full((ids.size, rows), np.nan, np.float32)
        cpu_kernels.gate_up(w, qtype, w[::-1].copy(), qtype, x, x_rows, eids, eids, ptr, a_in, a, h, ACT_SILU)
        return out, h

    together = products(ids, x, scale)
    for i in range(t):
        alone = products(ids[i : i + 1], x[i : i + 1], scale[i * per_token : (i + 1) * per_token])
        for got, ref in zip(together, alone, strict=True):
            assert not np.isnan(got[i * per_token : (i + 1) * per_token]).any()
            assert np.array_equal(got[i * per_token : (i + 1) * per_token], ref), (qtype.name, i)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_prompt_longer_than_a_token_block_gets_each_token_its_bits(qtype: Q) -> None:
    """An expert met by more tokens than one block (two blocks and a short third), its rows a power
    of two apart in the output (written a token's run at a time): every token as if alone."""
    rng = np.random.default_rng(3)
    rows, k = 64, 256
    w = quantized((2, rows, k), qtype, rng)
    t = 2 * TOKEN_BLOCK + 2
    ids = np.stack([np.zeros(t, np.int64), 1 + (np.arange(t) % 7 == 0)], axis=1)  # every 7th token: expert 2
    x = rng.standard_normal((t, k)).astype(np.float32)
    scale = rng.random(2 * t).astype(np.float32)

    def products(ids: np.ndarray, x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a, eids, ptr, a_in, x_rows = _selection(ids)
        ws = np.concatenate([w, w[:1]])  # expert 2: the first's bytes again
        out = np.full((ids.size, rows), np.nan, np.float32)
        cpu_kernels.matmul(ws, qtype, x, x_rows, eids, eids, ptr, a_in, a, out, scale=scale)
        h = np.full((ids.size, rows), np.nan, np.float32)
        cpu_kernels.gate_up(ws, qtype, ws[::-1].copy(), qtype, x, x_rows, eids, eids, ptr, a_in, a, h, ACT_SILU)
        return out, h

    together = products(ids, x, scale)
    assert np.bincount(ids[:, 0])[0] > 2 * TOKEN_BLOCK
    for i in range(t):
        alone = products(ids[i : i + 1], x[i : i + 1], scale[2 * i : 2 * i + 2])
        for got, ref in zip(together, alone, strict=True):
            assert not np.isnan(got[2 * i : 2 * i + 2]).any()
            assert np.array_equal(got[2 * i : 2 * i + 2], ref), (qtype.name, i)
