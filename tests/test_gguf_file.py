"""GGUF reading: agreement with gguf-py's reader, split files, memory, and every bad-file error."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from moechat.engine.gguf.reader import GGUFError, GGUFFile
from moechat.engine.models import ARCHITECTURES
from moechat.engine.models.opening import open_model
from testkit.ggufgen import Q, random_blocks, tiny_moe, write_gguf


def test_matches_gguf_reader(tiny_model: Path) -> None:
    ref = GGUFReader(tiny_model)
    with GGUFFile(tiny_model) as f:
        ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == ref_keys
        for key in ("qwen3moe.block_count", "qwen3moe.expert_count", "general.architecture"):
            assert f.metadata[key] == ref.fields[key].contents()
        assert f.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
        assert list(f.metadata["tokenizer.ggml.token_type"]) == ref.fields["tokenizer.ggml.token_type"].contents()
        assert len(f) == len(ref.tensors)
        for rt in ref.tensors:
            t = f[rt.name]
            assert t.qtype == rt.tensor_type
            assert t.shape == tuple(reversed([int(d) for d in rt.shape]))
            assert t.offset == rt.data_offset and t.n_bytes == rt.n_bytes
            assert np.array_equal(f.tensor_data(rt.name).reshape(-1).view(np.uint8), rt.data.reshape(-1).view(np.uint8))


def test_tensor_data_is_a_zero_copy_view(tiny_model: Path) -> None:
    with GGUFFile(tiny_model) as f:
        a = f.tensor_data("blk.0.ffn_up_exps.weight")
        b = f.tensor_data("blk.0.ffn_up_exps.weight")
        assert a.shape == (8, 256, 256 // 32 * 34)
        assert not a.flags.owndata
        assert np.shares_memory(a, b)


def _write_simple(
    path: Path, arch: str = "qwen3moe", extra: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None
) -> Path:
    meta = {f"{arch}.block_count": 1, **(extra or {})}
    t = tensors or {"a.weight": (np.arange(64, dtype=np.float32).reshape(2, 32), Q.F32)}
    return write_gguf(path, arch, meta, t, template=None)


def test_split_model_opens_as_one(tmp_path: Path) -> None:
    one = tmp_path / "m-00001-of-00002.gguf"
    two = tmp_path / "m-00002-of-00002.gguf"
    split = {"split.count": 2, "split.tensors.count": 2}
    _write_simple(one, extra={**split, "split.no": 0}, tensors={"a.weight": (np.ones((2, 32), np.float32), Q.F32)})
    _write_simple(two, extra={**split, "split.no": 1}, tensors={"b.weight": (np.full((4, 32), 2, np.float32), Q.F32)})
    with GGUFFile(one) as f:
        assert sorted(f) == ["a.weight", "b.weight"]
        assert f.tensor_data("b.weight").view(np.float32).mean() == 2.0
        assert f.file_size == one.stat().st_size + two.stat().st_size
    two.unlink()
    with pytest.raises(GGUFError, match="missing m-00002-of-00002.gguf"):
        GGUFFile(one)


def test_opening_a_large_file_reads_only_the_header(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    n_rows = 210 * 2**20 // 34 // 8  # Q8_0 rows of 256 values: about 210 MiB
    data = np.zeros((n_rows, 8 * 34), dtype=np.uint8)
    _write_simple(path, tensors={"big.weight": (data, Q.Q8_0)})
    del data
    assert path.stat().st_size >= 200 * 10**6
    code = (
        "import sys\n"
        "from moechat.engine.gguf.reader import GGUFFile\n"
        "def kb(field):\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith(field)).split()[1])\n"
        "before = kb('VmRSS:')\n"
        "f = GGUFFile(sys.argv[1])\n"
        "view = f.tensor_data('big.weight')\n"
        "print(kb('VmHWM:') - before, view.shape[0])\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    grown_kb, rows = map(int, r.stdout.split())
    assert rows == n_rows
    assert grown_kb < 16 * 1024, f"opening grew peak RSS by {grown_kb} KiB"


# -- bad files -------------------------------------------------------------------------


@pytest.fixture()
def good_file(tmp_path: Path) -> Path:
    return _write_simple(tmp_path / "good.gguf")


def _patched(src: Path, dst: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[offset : offset + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def test_wrong_magic(good_file: Path, tmp_path: Path) -> None:
    bad = _patched(good_file, tmp_path / "bad.gguf", 0, b"GGML")
    with pytest.raises(GGUFError, match=r"bad\.gguf: offset 0: not a GGUF file"):
        GGUFFile(bad)


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(good_file: Path, tmp_path: Path, version: int) -> None:
    bad = _patched(good_file, tmp_path / "bad.gguf", 4, struct.pack("<I", version))
    with pytest.raises(GGUFError, match=rf"offset 4: unsupported GGUF version {version}"):
        GGUFFile(bad)


@pytest.mark.parametrize("cut", [30, 60, 100])
def test_truncated_header(good_file: Path, tmp_path: Path, cut: int) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good_file.read_bytes()[:cut])
    with pytest.raises(GGUFError, match=r"\.gguf: offset \d+: truncated file"):
        GGUFFile(bad)


def test_tensor_data_past_end(good_file: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good_file.read_bytes()[:-16])
    with pytest.raises(GGUFError, match=r"tensor 'a.weight' data \(256 bytes at offset \d+\) runs past the end"):
        GGUFFile(bad)


def test_absurd_counts_are_refused_before_use(good_file: Path, tmp_path: Path) -> None:
    bad = _patched(good_file, tmp_path / "bad.gguf", 16, struct.pack("<Q", 2**62))
    with pytest.raises(GGUFError, match="metadata count 4611686018427387904 cannot fit"):
        GGUFFile(bad)
    bad = _patched(good_file, tmp_path / "bad2.gguf", 8, struct.pack("<Q", 2**40))
    with pytest.raises(GGUFError, match="tensor count 1099511627776 cannot fit"):
        GGUFFile(bad)


def test_unknown_quant_type_id(good_file: Path, tmp_path: Path) -> None:
    raw = good_file.read_bytes()
    name = raw.index(b"a.weight")
    type_at = name + len(b"a.weight") + 4 + 2 * 8  # after n_dims and two dims
    bad = _patched(good_file, tmp_path / "bad.gguf", type_at, struct.pack("<I", 9999))
    with pytest.raises(GGUFError, match="tensor 'a.weight' has unknown quant type id 9999"):
        GGUFFile(bad)


def test_missing_required_key(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "qwen3moe", {"qwen3moe.block_count": 2}, {}, template=None)
    with pytest.raises(GGUFError, match=r"key qwen3moe\.embedding_length: required .* missing"):
        open_model(path)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    path = _write_simple(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'") as e:
        open_model(path)
    for arch in ARCHITECTURES:
        assert arch in str(e.value)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tiny_moe(tmp_path / "m.gguf", n_vocab=256)
    # Rewrite one expert tensor as IQ2_XXS: a type gguf knows but moechat has no kernel for.
    extra = tmp_path / "iq2.gguf"
    w = GGUFWriter(str(extra), "qwen3moe")
    with GGUFFile(path) as src:
        for key, value in src.metadata.items():
            if key in ("general.architecture",):
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                w.add_uint32(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
        for name, t in src.tensors.items():
            if name == "blk.1.ffn_up_exps.weight":
                w.add_tensor(name, random_blocks(Q.IQ2_XXS, t.n_elements // 256, rng).reshape(8, 256, 66),
                             raw_dtype=Q.IQ2_XXS)  # fmt: skip
            else:
                w.add_tensor(name, src.tensor_data(name).copy(), raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="tensor 'blk.1.ffn_up_exps.weight' has unsupported quant type IQ2_XXS"):
        open_model(extra)


@pytest.mark.slow
def test_cli_inspect_bad_file_one_line_exit_2(good_file: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good_file.read_bytes()[:50])
    r = subprocess.run([sys.executable, "-m", "moechat", "inspect", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moechat: error: ") and "truncated" in lines[0]
    r = subprocess.run([sys.executable, "-m", "moechat", "inspect", str(tmp_path / "nope.gguf")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "cannot open" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_inspect_table(tiny_model: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "moechat", "inspect", str(tiny_model)],
        capture_output=True, text=True, env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "qwen3moe" in out
    assert "8 per layer, 2 used per token, FFN 256" in out
    # 2 layers x 3 tensors x 8 experts x 256 rows x (256/32*34) bytes
    assert f"{2 * 3 * 8 * 256 * 272 / 2**20:,.1f} MiB total" in out
    assert "Q8_0 x6" in out and "F32 x21" in out
    assert "chat template" in out and "yes" in out


@pytest.mark.slow
def test_cli_inspect_shows_metadata_as_written_never_as_markup(tmp_path: Path) -> None:
    """A file's own strings are untrusted: rich markup in them ("[/x]" raises, "[link=...]" makes
    a terminal link) must print as plain text."""
    name = "[/x] evil [link=https://example.invalid]click[/link]"
    path = tiny_moe(tmp_path / "[b]odd[red].gguf", extra={"general.name": name})
    r = subprocess.run([sys.executable, "-m", "moechat", "inspect", str(path)], capture_output=True, text=True,
                       env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert name in r.stdout and "[b]odd[red].gguf" in r.stdout


def _map_pages(path: Path) -> tuple[int, int]:
    """(resident bytes, anonymous bytes) of this process's maps of `path`, from /proc/self/smaps: a page
    copied on write would be anonymous (a file's own pages may count as dirty until written back)."""
    rss = copied = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line and not line[0].isupper():  # a mapping's header: address range, perms, ..., path
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
        elif inside and line.startswith("Anonymous:"):
            copied += int(line.split()[1]) * 1024
    return rss, copied


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_a_loaded_model_maps_its_pages_ahead_without_copying_them(tmp_path: Path) -> None:
    """After load the file's pages are mapped into the process in the background (no page faults left
    for decode), each once: resident at most the file's size, nothing copied."""
    from moechat.engine.loader import load_model

    path = tiny_moe(tmp_path / "m.gguf", n_layers=4, n_embd=512, n_expert=16, n_ff_exp=512, n_vocab=4096)
    size = path.stat().st_size
    lm = load_model(path, n_ctx=64)
    try:
        pre = lm.gguf._prefault
        assert pre is not None and pre.done.wait(30)
        if pre.bytes == 0:
            pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
        assert pre.bytes == size
        rss, copied = _map_pages(path)
        assert 0.95 * size <= rss <= size + 4096 and copied < 0.01 * size, (rss, copied, size)
    finally:
        lm.close()


def test_closing_a_file_stops_its_prefault(tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_layers=4, n_embd=512, n_expert=16, n_ff_exp=512, n_vocab=4096)
    f = GGUFFile(path)
    pre = f.prefault()
    f.close()  # stops it within a chunk and waits for it
    assert pre.done.is_set() and not pre._thread.is_alive() and f._prefault is None
