"""A first start compiles on two cores: the helper process compiles the very kernels a load needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from moechat.engine.loader import load_model
from moechat.engine.models import compile_ahead
from testkit.ggufgen import Q, tiny_moe


def test_a_load_starts_the_helper_once_per_kind_of_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose kind was never compiled here starts the helper, stops it once its own forward is
    through, and stamps the kind; the next load of that kind starts none."""
    path = tiny_moe(tmp_path / "m.gguf")
    monkeypatch.setenv("MOECHAT_COMPILE_AHEAD", "1")
    # The stamps in an empty folder; numba itself keeps the suite's warm cache (it read the variable at import).
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "kernels"))
    started: list[subprocess.Popen[bytes] | None] = []
    start = compile_ahead.start

    def spy(*args: object) -> subprocess.Popen[bytes] | None:
        started.append(start(*args))  # type: ignore[arg-type,unused-ignore]
        return started[-1]

    monkeypatch.setattr(compile_ahead, "start", spy)
    for _ in range(2):
        load_model(path, n_ctx=64).close()
    first, second = started
    assert first is not None and first.returncode is not None  # started, then stopped by the load
    assert second is None
    assert len(list((tmp_path / "kernels" / "models").iterdir())) == 1


KERNEL_FOLDER = """
import sys
import numba  # first, as pytest's warning filter does: numba then reads no cache folder of ours
import numpy as np
from moechat.engine.kernels import cpu
from testkit.ggufgen import Q, quantized
raw = quantized((16, 256), Q.Q4_K, np.random.default_rng(0))
cpu.dense(raw, Q.Q4_K, np.ones((1, 256), np.float32))
"""


def test_kernels_cache_in_the_folder_named_after_their_sources_even_when_numba_came_first(tmp_path: Path) -> None:
    """Beside cpu.py numba would check a cached kernel against cpu.py alone, and load a stale one after
    a block layout changed in qblocks.py."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=str(Path(__file__).parent))
    subprocess.run([sys.executable, "-c", KERNEL_FOLDER], env=env, check=True, timeout=600)
    folder = tmp_path / "moechat" / "kernels"  # platformdirs' cache folder under XDG_CACHE_HOME
    assert any(p.name.startswith("cpu._experts_kernel") for p in folder.rglob("*.nbi")), list(tmp_path.rglob("*"))


FIRST_PROMPT = """
import sys, torch
from moechat.engine.generate import decode_one
from moechat.engine.kernels.jit import compile_notes
from moechat.engine.loader import load_model
loading = []
lm = load_model(sys.argv[1], n_ctx=64, progress=loading.append)
kv = lm.new_cache()
notes = []
with compile_notes(notes.append), torch.inference_mode():
    decode_one(lm.model, int(lm.model(torch.arange(1, 21), 0, kv)[-1].argmax()), kv)
print(sum("compiling" in n for n in loading), len(notes))
"""


@pytest.mark.slow
def test_the_helper_compiles_what_a_load_and_a_first_prompt_need(tmp_path: Path) -> None:
    """From an empty kernel cache the helper alone compiles; a load after it then compiles nothing, nor
    does a first prompt: the helper's kernels are the load's specializations, and they cover what a prompt
    runs that the load's one token does not (its experts' general kernels, its dense matrices' tiles (Q4_K
    attention: a kernel the experts' Q6_K down does not compile)), with the activation widths
    the model then runs: the load warms them the same way, so a first reply waits for no compile."""
    path = tiny_moe(tmp_path / "m.gguf", expert_type=Q.Q4_K, dense_type=Q.Q4_K, down_type=Q.Q6_K)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "kernels"), "MOECHAT_COMPILE_AHEAD": "0"}
    helper = subprocess.run([sys.executable, "-m", compile_ahead.__name__, str(path), "64", "fast"], env=env,
                            capture_output=True, timeout=600)  # fmt: skip
    assert helper.returncode == 0, helper.stderr.decode()[-2000:]
    assert any((tmp_path / "kernels").rglob("*.nbi"))  # it wrote the disk cache
    r = subprocess.run([sys.executable, "-c", FIRST_PROMPT, str(path)], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", "0"]  # (kernels the load compiled, kernels the prompt compiled)
