"""The fast path on real weights: one token at a time through the kernels and the compiled layer
halves, against the exact path (dequantized weights, float32 matmuls).

Bounds over 256 positions: int16 activations agree on the top token at >= 99%
of them, mean KL <= 1e-3 (measured 100%, 3e-8 to 6e-6); `--cpu-kernels int8` (llama.cpp's
approximation) at >= 93%, KL <= 5e-3 (measured 94.9% to 96.5%, 2e-3 to 3e-3). The same text as one
prompt (its matrices in the kernels' tiles) keeps the same bounds.
"""

from __future__ import annotations

import pytest
import torch
from moechat.engine.loader import load_model

TEXT = (
    "The old harbour town wakes before the sun. Fishing boats slide out past the breakwater while the bakery on "
    "the square lights its ovens, and by six the smell of bread reaches the church steps. Most visitors come in "
    "summer for the beaches, but the locals prefer the autumn, when the storms roll in from the west and the "
    "market sells apples, walnuts and smoked fish. The museum by the lighthouse keeps a small collection of "
    "maps, ship models and letters written by sailors to their families; one of them describes a voyage to "
    "Lisbon in 1821 that took forty days because of the winds. In the evening people gather at the tavern, "
    "where an old accordion player knows every song the town has ever sung. Children learn to swim in the "
    "cold water of the bay, and every spring the school holds a race around the island in rowing boats painted "
    "in bright colours. When the first frost comes, the boats are pulled onto the sand and repaired, nets are "
    "mended, and the town grows quiet again until the next season begins. The mayor, a retired teacher, "
    "likes to say that the town has only two seasons: the one when everyone is busy and the one when everyone "
    "complains about having nothing to do. Her office keeps a ledger of every ship that has entered the "
    "harbour since 1870, and on rainy afternoons she reads it aloud to anyone who will listen, stopping to "
    "explain the names of the captains, the cargo they carried and the ports they had come from."
)
POSITIONS = 256


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.double(), dim=-1)


BOUNDS = {"int16": (0.99, 1e-3), "int8": (0.93, 5e-3)}  # (top-1 agreement >=, mean KL <=)


@pytest.mark.slow
@pytest.mark.parametrize(("which", "kernels"), [("gemma_gguf", "int16"), ("demo_gguf", "int16"), ("demo_gguf", "int8")])
def test_fast_decode_agrees_with_the_exact_path(which: str, kernels: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(which)
    exact = load_model(path, n_ctx=POSITIONS + 8, cpu_kernels="exact")
    ids = exact.tokenizer.encode(TEXT)[:POSITIONS]
    assert len(ids) == POSITIONS
    with torch.inference_mode():
        ref = _log_softmax(exact.model(torch.tensor(ids), 0, exact.new_cache()))  # [P, V]
        exact.close()
        fast = load_model(path, n_ctx=POSITIONS + 8, cpu_kernels=kernels)
        cache = fast.new_cache()
        got = _log_softmax(torch.cat([fast.model(torch.tensor([t]), i, cache) for i, t in enumerate(ids)]))
        # The whole text as one prompt: its matrices multiply in the kernels' tiles, rounded as decode rounds.
        prompt = _log_softmax(fast.model(torch.tensor(ids), 0, fast.new_cache()))
        fast.close()
    min_top1, max_kl = BOUNDS[kernels]
    for name, out in (("decode", got), ("prompt", prompt)):
        top1 = float((out.argmax(-1) == ref.argmax(-1)).double().mean())
        kl = float((ref.exp() * (ref - out)).sum(-1).mean())  # KL(exact || fast) per position, averaged
        assert top1 >= min_top1, (name, top1)
        assert kl <= max_kl, (name, kl)
