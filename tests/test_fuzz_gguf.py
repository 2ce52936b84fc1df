"""Hostile and broken GGUF files: every mutation ends in a clear error (or a valid model), fast, no traceback.

The fast subset runs here (KINDS x 25 = 250 files through the parser and the config, a sample
through `moechat inspect` and `moechat run`); scripts/fuzz_gguf.py runs as many as asked.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from moechat.app.cli import main
from moechat.engine.models.opening import open_model
from testkit.gguf_fuzz import KINDS, mutate
from testkit.gguf_layout import layout
from testkit.ggufgen import tiny_moe
from testkit.timing import baseline_seconds

PER_KIND = 25
UNITS_PER_FILE = 200  # a file's refusal or acceptance, in units of testkit.timing.baseline_seconds (about 2 s here)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tiny_moe(tmp_path_factory.mktemp("fuzz") / "base.gguf", n_layers=1, n_embd=32, n_head=2, n_ff_exp=32,
                    n_expert=4, n_vocab=300)  # fmt: skip
    return path.read_bytes()


def test_layout_walker_finds_the_fields(base: bytes) -> None:
    lay = layout(base)
    assert lay.keys and lay.dims and lay.tensor_offsets and lay.header_end < len(base)


@pytest.mark.parametrize("kind", KINDS)
def test_mutated_files_fail_cleanly(base: bytes, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    lay = layout(base)
    rng = random.Random(f"fuzz-{kind}")
    outcomes = {"error": 0, "ok": 0}
    per_file = UNITS_PER_FILE * baseline_seconds()
    for i in range(PER_KIND):
        path = tmp_path / f"{kind}-{i}.gguf"
        path.write_bytes(mutate(base, lay, rng, kind))
        t = time.monotonic()
        try:
            gguf, _ = open_model(path)
            gguf.close()
            outcomes["ok"] += 1
        except ValueError as e:  # GGUFError and the config's refusals are ValueErrors with one clear line
            msg = str(e)
            assert msg and "\n" not in msg.strip(), msg
            outcomes["error"] += 1
        assert time.monotonic() - t < per_file, f"{kind} #{i} took too long"
        if i % 8 == 0:  # a sample through the commands a user runs
            for argv in (["inspect", str(path)], ["run", str(path), "-p", "hi", "-n", "2", "--temp", "0"]):
                rc = main(argv)
                err = capsys.readouterr().err
                assert rc in (0, 2), (argv, rc)
                assert "Traceback" not in err
                if rc == 2:
                    assert len(err.strip().splitlines()) == 1 and err.startswith("moechat: error: "), err
    if kind in ("truncate", "count", "strlen", "tensor_offset"):
        assert outcomes["error"] >= PER_KIND * 0.8, outcomes  # these damage the file almost always
