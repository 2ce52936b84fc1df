"""Another engine's routing (route_trace v1 CSV) replayed by `moechat sim` as it is: layers with the same
expert size share a bank, each step is a token, bad files fail on the line that is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from moechat.app.cli import main
from moechat.tuner.baselines import simulate_baseline
from moechat.tuner.simulator import load_routing, replay

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real-routing" / "gemma.route.csv"
ROWS = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"


def _write(path: Path, steps: list[list[list[int]]], sizes: tuple[int, ...] = (1000, 1000, 2000),
           n_expert: int = 8, k: int = 2, extra: str = "") -> Path:  # fmt: skip
    """steps[t][layer] = the experts token t selected in that layer."""
    lines = ["# route_trace v1", f"# model=x.gguf arch=test n_layer={len(sizes)} n_expert={n_expert} n_expert_used={k}"]
    lines += [f"# layer={i} expert_bytes={b} dense_bytes=1" for i, b in enumerate(sizes)]
    lines.append(ROWS)
    for t, layers in enumerate(steps):
        for layer, ids in enumerate(layers):
            for slot, e in enumerate(ids):
                lines.append(f"0,{int(t >= 2)},{t},{layer},{slot},{e},{1 / k:.3f},0,{sizes[layer] if slot else 0}")
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def _steps(n: int) -> list[list[list[int]]]:
    return [[[t % 8, (t + 3) % 8], [(2 * t) % 8, (2 * t + 1) % 8], [t % 3, 3 + t % 5]] for t in range(n)]


def test_a_route_csv_replays_as_one_bank_per_expert_size(tmp_path: Path) -> None:
    routing = load_routing(_write(tmp_path / "r.csv", _steps(40)))
    assert [(g.layers, g.expert_bytes) for g in routing.groups] == [((0, 1), 1000), ((2,), 2000)]
    assert routing.n_tokens == 40 and routing.n_expert_used == 2
    assert routing.layer_steps(2)[:3] == [[0, 3], [1, 4], [2, 5]]  # slot order
    res = replay(routing, routing.full_mib() / 2, 0.0, warmup=8)
    assert res.tokens == 32 and 0 < res.hit_rate < 1
    best = simulate_baseline(routing, routing.slots(routing.full_mib() / 2), "min", warmup=8)
    assert best.misses <= res.total.misses
    assert sum(n for _, n, _ in best.by_layer) == best.lookups and {la for la, _, _ in best.by_layer} == {0, 1, 2}


def test_sim_reads_a_route_csv_and_shows_each_layer_beside_min(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    path = _write(tmp_path / "r.csv", _steps(40))
    assert main(["sim", str(path), "--sizes", "0.015", "--warmup", "8", "--policy", "classlru", "min",
                 "--per-layer"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "r.csv: 40 tokens, 120 lookups" in out and "hit rate per layer" in out
    per_layer = out.split("hit rate per layer")[1].splitlines()
    assert [line.split()[0] for line in per_layer[3:6]] == ["0", "1", "2"]
    assert all("% / " in line for line in per_layer[3:6])


def test_a_size_that_holds_no_slot_is_said_not_scored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cache too small for one slot is no cache: its row would read "0 misses, vs MIN 1.00"."""
    path = _write(tmp_path / "r.csv", _steps(40))
    assert main(["sim", str(path), "--sizes", "0.0001", "0.015", "--warmup", "8", "--policy", "classlru"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "classlru" in line]
    assert len(rows) == 1 and "0.015" in rows[0]
    assert "note: 0.0001 MiB hold no expert slot" in out


@pytest.mark.parametrize(
    ("extra", "header", "message"),
    [
        ("", "# route_trace v2", "r.csv:1: not a route_trace v1 file"),
        ("0,1,40,0,0,9,0.5,0,0\n", None, "r.csv:247: expert 9 is outside 0..7"),
        ("0,1,40,0,0,x,0.5,0,0\n", None, "r.csv:247: expert 'x' is not a whole number"),
        ("0,1,40,0,0,1,0.5,0,0\n", None, "selects 1 experts, not n_expert_used = 2"),
        ("0,1,40,7,0,1,0.5,0,0\n", None, "r.csv:247: layer 7 is outside 0..2"),
        ("0,1,40,0,0,1\n", None, "r.csv:247: 6 fields, not 9"),
    ],
)
def test_a_bad_route_csv_is_one_line_naming_the_line(tmp_path: Path, extra: str, header: str | None,
                                                     message: str) -> None:  # fmt: skip
    path = _write(tmp_path / "r.csv", _steps(40), extra=extra)
    if header is not None:
        path.write_text(path.read_text().replace("# route_trace v1", header, 1))
    r = subprocess.run([sys.executable, "-m", "moechat", "sim", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


@pytest.mark.skipif(not SHARED.is_file(), reason="the shared real-routing data is not beside the checkout")
def test_real_routing_classlru_between_min_and_lru() -> None:
    """Gemma-4-26B-A4B's routing (30 MoE layers, 128 experts, top-6), scored as the sim scores it: the
    engine's policy never misses more than LRU, and no policy beats MIN."""
    routing = load_routing(SHARED)
    assert routing.n_tokens == 157 and len(routing.groups) == 2 and routing.n_expert_used == 6
    warmup = 29 + 16  # the prompt, then the first 16 decode tokens
    for fraction in (0.1, 0.2, 0.3):
        mib = fraction * routing.full_mib()
        slots = routing.slots(mib)
        ours = replay(routing, mib, 0.0, warmup=warmup).total.misses
        lru = simulate_baseline(routing, slots, "lru", warmup=warmup).misses
        best = simulate_baseline(routing, slots, "min", warmup=warmup).misses
        assert best < ours <= lru, (fraction, best, ours, lru)
