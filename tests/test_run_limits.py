"""Memory bounds while running, Ctrl+C, and the one-line errors of `moechat run`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit.ggufgen import ARCHS, Q, tiny_moe

MOECHAT = [sys.executable, "-m", "moechat"]


@pytest.mark.slow
def test_peak_rss_stays_near_the_file_size(tmp_path: Path) -> None:
    # 4 layers x 256 experts of Q8_0: about 214 MB of experts. Dequantized they would be 805 MB.
    path = tiny_moe(tmp_path / "big.gguf", n_layers=4, n_expert=256, n_expert_used=8, n_vocab=512)
    size = path.stat().st_size
    assert size >= 200 * 10**6
    warmup = tiny_moe(tmp_path / "warmup.gguf", n_vocab=512)
    code = (
        "import sys\n"
        "from moechat.engine.loader import load_model\n"
        "from moechat.engine.generate import generate, GREEDY\n"
        "def kb(field):\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith(field)).split()[1]) * 1024\n"
        "# Library code that the first run pages in is not model memory: run a tiny model first.\n"
        "small = load_model(sys.argv[2], n_ctx=256)\n"
        "*_, done = generate(small.model, small.tokenizer, [1, 2, 3], small.new_cache(), max_tokens=4)\n"
        "small.gguf.close()\n"
        "del small\n"
        "before = kb('VmRSS:')\n"
        "lm = load_model(sys.argv[1], n_ctx=256)\n"
        "cache = lm.new_cache()\n"
        "kv = sum(l.k.numel() * 4 + l.v.numel() * 4 for l in cache.layers)\n"
        "prompt = lm.tokenizer.encode('The history of the river town, told by its oldest inhabitants, ' * 4)\n"
        "*_, done = generate(lm.model, lm.tokenizer, prompt, cache, max_tokens=16, ignore_eos=True)\n"
        "n = done.n_generated\n"
        "print(kb('VmHWM:') - before, kv, n)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(path), str(warmup)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    grown, kv, n_generated = map(int, r.stdout.split())
    assert n_generated == 16
    assert grown <= 1.1 * size + kv, f"peak RSS grew {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_run_each_architecture(arch: str, tmp_path: Path) -> None:
    qtype = Q.MXFP4 if arch == "gpt-oss" else Q.Q8_0
    model = tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=qtype, n_vocab=512)
    cmd = [*MOECHAT, "run", str(model), "-p", "Once upon a time", "-n", "10", "--temp", "0", "--ignore-eos", "--chat"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "prompt: " in r.stderr and "generation: 10 tokens" in r.stderr


@pytest.mark.slow
def test_threads_flag_sets_the_engine_threads(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=300)
    for n in ("1", "3"):
        cmd = [*MOECHAT, "-v", "run", str(model), "-p", "hi", "-n", "2", "--temp", "0", "--threads", n]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"{n} intra-op threads" in r.stderr


@pytest.mark.slow
def test_ctrl_c_keeps_the_text_and_exits_130(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)
    cmd = [*MOECHAT, "run", str(model), "-p", "Hello", "-n", "100000", "--ignore-eos", "-c", "100000", "--seed", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Python turns SIGINT into KeyboardInterrupt only if it starts with the default disposition;
    # a test run started in the background by a non-interactive shell hands its children SIG_IGN.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    seen = b""
    deadline = time.monotonic() + 120
    while len(seen) < 20 and time.monotonic() < deadline:  # poll until text streams
        chunk = proc.stdout.read()
        seen += chunk or b""
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    assert len(seen) >= 20, "no streamed text before the deadline"
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"interrupted" in err and b"Traceback" not in err
    # The streamed text stays where it was and its line is ended: the terminal's next prompt
    # starts on a line of its own.
    out = (seen + (rest or b"")).decode()
    assert out.endswith("\n") and len(out.strip()) >= 20


@pytest.mark.slow
def test_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*MOECHAT, "run", *args], capture_output=True, text=True, timeout=120)

    import numpy as np
    from testkit.ggufgen import write_gguf

    for arch, msg in (("qwen2", "missing (the file has no tokenizer)"), ("mamba", "unsupported architecture 'mamba'")):
        meta = {f"{arch}.block_count": 1, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 2}
        bad = write_gguf(tmp_path / "d.gguf", arch, meta, {"a.weight": (np.zeros((2, 32), np.float32), Q.F32)})
        r = run(str(bad), "-p", "hi")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and msg in r.stderr, r.stderr
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=300)
    for args, msg in [
        (("--temp", "-1"), "temp from flag --temp: -1.0 must be >= 0"),
        (("--top-p", "1.5"), "top_p from flag --top-p: 1.5 must be in (0, 1]"),
        (("-n", "-3"), "n_predict from flag --n-predict: -3 must be > 0"),
        (("-c", "4"), "ctx_size from flag --ctx-size: 4 must be in 16..1048576"),
        (("--chat-template", str(tmp_path / "none.jinja")), "cannot read chat template"),
        (("--threads", "-1"), "threads from flag --threads: -1 must be in 0..1024"),
    ]:
        r = run(str(model), "-p", "hi", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and msg in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bad_files_and_values_fail_before_the_engine_loads(tmp_path: Path) -> None:
    """Every command line's bad model file or value: the one-line error, exit 2, with neither torch, numba
    nor textual imported, and about as fast as `--version` (the baseline this machine gives now)."""
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(tiny_moe(tmp_path / "m.gguf", n_vocab=300).read_bytes()[:100])
    cases = [
        (["/nonexistent/m.gguf"], "/nonexistent/m.gguf: cannot open: No such file or directory"),
        (["run", "", "-p", "hi"], "the model path is empty"),
        (["run", str(tmp_path), "-p", "hi"], "is a directory, not a GGUF file"),
        (["tune", str(truncated)], "truncated file or bad count"),
        (["inspect", str(truncated)], "truncated file or bad count"),
        (["--moe-cache-mib", "-5"], "moe_cache_mib from flag --moe-cache-mib: -5.0 must be >= 0"),
        (["frobnicate"], "'frobnicate' is neither a command (inspect, chat, run"),
        (["sim", str(tmp_path / "nope.csv")], "nope.csv: no such trace file"),
    ]
    code = (
        "import sys, contextlib, io\n"
        "from moechat.app.cli import main\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    rc = main(sys.argv[1:])\n"
        "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'numba', 'textual'))\n"
        "print(rc, heavy, err.getvalue().strip().replace(chr(10), ' | '))\n"
    )
    for argv, msg in cases:
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("2 [] moechat: error: ") and msg in r.stdout and " | " not in r.stdout, r.stdout

    def seconds(*argv: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([*MOECHAT, *argv], capture_output=True, timeout=120)
        return time.perf_counter() - t0

    baseline = min(seconds("--version") for _ in range(3))
    for argv, _ in cases:
        assert min(seconds(*argv) for _ in range(2)) <= 4 * baseline, argv


@pytest.mark.slow
def test_a_first_start_says_it_is_compiling_and_a_second_does_not(tmp_path: Path) -> None:
    """A `moechat run` that compiles kernels names them for this CPU instead of going quiet; with the
    kernels in the disk cache the next run says nothing of it."""
    import moechat.engine.kernels.jit  # noqa: F401  (it names the suite's kernel cache in NUMBA_CACHE_DIR)

    model = tiny_moe(tmp_path / "m.gguf", n_vocab=300)

    def run(cache: Path) -> subprocess.CompletedProcess[str]:
        cmd = [*MOECHAT, "run", str(model), "-p", "hi", "-n", "2"]
        env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)

    # The suite's kernel cache holds this model's kernels after one run (it compiles them for the tests
    # that share them); a copy less a few small kernels (the norm's and the routing's) and the first
    # starts' counts is a first start that compiles those, not the minute of all of them (which
    # test_compile_ahead runs).
    shared = Path(os.environ["NUMBA_CACHE_DIR"])
    assert run(shared).returncode == 0
    cache = tmp_path / "kernels"
    small = ("layer_halves.rms_compiled*", "layer_halves.route*", "layer_halves.select*")
    shutil.copytree(shared, cache, ignore=shutil.ignore_patterns("models", *small))
    assert any(cache.rglob("layer_halves.*.nbi")) and not any(cache.rglob("layer_halves.rms_compiled*"))
    first = run(cache)
    assert first.returncode == 0, first.stderr
    # In words, counting up, with no total to drift past (one estimated from other models' first starts did).
    assert (
        "moechat: compiling kernels for this model (first start only, a minute or two on 2 cores): 1 compiled\n"
        in first.stderr
    ), first.stderr
    last = re.search(r": (\d+) compiled, done", first.stderr)
    assert last is not None and int(last[1]) > 1 and "of about" not in first.stderr, first.stderr
    assert "now " not in first.stderr  # no numba function names
    second = run(cache)
    assert second.returncode == 0 and "compiling" not in second.stderr, second.stderr


def test_ctrl_c_inside_a_kernel_is_an_interrupt_not_a_crash() -> None:
    """What a kernel hands back when Ctrl-C lands in its call back into Python (seen on first calls):
    a SystemError whose chain of causes holds the KeyboardInterrupt."""
    from moechat.engine.generate import ctrl_c_as_itself

    def kernel_returns_with_a_pending_interrupt() -> None:
        try:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as e:
                raise SystemError("<function _numba_unpickle> returned a result with an exception set") from e
        except SystemError as e:
            raise SystemError("CPUDispatcher(moe) returned a result with an exception set") from e

    with pytest.raises(KeyboardInterrupt), ctrl_c_as_itself():
        kernel_returns_with_a_pending_interrupt()
    with pytest.raises(SystemError, match="a real one"), ctrl_c_as_itself():
        raise SystemError("a real one")
