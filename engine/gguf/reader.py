"""Reading GGUF files: a validating header parser over a memory map.

The header is parsed here rather than with `gguf.GGUFReader` because every count and
length in it is untrusted: each one is checked against the bytes that remain before it
is used, so a hostile file can neither make us loop for ages nor allocate by its say-so,
and every error names the offset where the file went wrong. Tensor data is never read:
`tensor_data()` returns a zero-copy view into the map. The tests cross-check this parser
against `gguf.GGUFReader` on the files they write.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
import struct
import sys
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from .prefault import Prefault

# Linux's MAP_NORESERVE (mmap has the name from Python 3.13); 0 elsewhere, where it is not needed.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.")


def block_index(name: str) -> int | None:
    """The block (layer) a tensor belongs to, from its name (`blk.N.*`); None for the embedding, the output
    norm and head, and other tensors outside the blocks."""
    m = _BLOCK_NAME.match(name)
    return int(m.group(1)) if m is not None else None


logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_KEY_LENGTH = 65_535
# A metadata array longer than this is not a real model's; refusing it keeps a hostile
# count from costing seconds of parsing even when the file is large enough to hold it.
MAX_ARRAY_LENGTH = 1 << 26

_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the path and the place in it."""


# GGUF value types: id -> (name, struct code or None for the composite types).
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("u8", "<B"),
    1: ("i8", "<b"),
    2: ("u16", "<H"),
    3: ("i16", "<h"),
    4: ("u32", "<I"),
    5: ("i32", "<i"),
    6: ("f32", "<f"),
    7: ("bool", "<?"),
    10: ("u64", "<Q"),
    11: ("i64", "<q"),
    12: ("f64", "<d"),
}
_NUMPY_OF: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING = 8
_ARRAY = 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: GGUF name, quant type, torch-order shape and where its bytes are."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: the last dimension is GGUF's ne0, the contiguous one
    n_bytes: int
    offset: int  # absolute offset of the first byte in its shard
    shard: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size


class _Cursor:
    """Bounds-checked little-endian reads from a buffer, with errors naming the offset."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def fail(self, msg: str, offset: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: offset {self.pos if offset is None else offset}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated file: {what} needs {n} bytes, {self.size - self.pos} remain")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str, limit: int | None = None) -> str:
        start = self.pos
        n = self.unpack("<Q", f"length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (at most {limit} allowed)", start)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason})", start) from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][1], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str) -> Any:
        start = self.pos
        etype = self.unpack("<I", f"element type of {what}")
        count = self.unpack("<Q", f"length of {what}")
        if count > MAX_ARRAY_LENGTH:
            raise self.fail(f"{what} claims {count} elements (at most {MAX_ARRAY_LENGTH})", start)
        if etype in _NUMPY_OF:
            itemsize = struct.calcsize(_SCALARS[etype][1])
            self.need(count * itemsize, f"{count} elements of {what}")
            arr = np.frombuffer(self.buf, dtype=_NUMPY_OF[etype], count=count, offset=self.pos).copy()
            self.pos += count * itemsize
            return arr.astype(bool) if etype == 7 else arr
        if etype == _STRING:
            # Each string takes at least its 8-byte length: check the whole count first.
            self.need(count * 8, f"{count} strings of {what}")
            return [self.string(f"{what}[{i}]") for i in range(count)]
        if etype == _ARRAY:
            self.need(count * 12, f"{count} nested arrays of {what}")
            return [self.array(f"{what}[{i}]") for i in range(count)]
        raise self.fail(f"{what} has unknown element type {etype}", start)


class _Shard:
    """One mapped file: its metadata, tensor infos and the map itself."""

    def __init__(self, path: Path, index: int) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise GGUFError(f"{path}: cannot open: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise GGUFError(f"{path}: is a directory, not a GGUF file")
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(f"{path}: not a regular file")
            size = st.st_size
            if size < 24:
                raise GGUFError(f"{path}: offset 0: not a GGUF file (only {size} bytes)")
            # A private writable map (copy-on-write): torch and the compiled kernels take its views as
            # ordinary arrays, and we never write, so no page is ever copied. MAP_NORESERVE: the kernel
            # reserves no memory for copies that never happen, so a file larger than RAM maps too
            # (a plain private writable map of it is refused with ENOMEM under the default overcommit).
            self.map = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE | MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[int, int | None]] = {}  # key -> (type, element type of arrays)
        self.tensors: list[TensorInfo] = []
        self._parse(index)

    def _parse(self, index: int) -> None:
        cur = _Cursor(self.map, self.path)
        magic = bytes(self.map[0:4])
        if magic != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})", 0)
        cur.pos = 4
        version = cur.unpack("<I", "version")
        if version & 0xFFFF == 0 and version != 0:
            raise cur.fail("big-endian GGUF files are not supported", 4)
        if version not in SUPPORTED_VERSIONS:
            raise cur.fail(f"unsupported GGUF version {version} (supported: 2, 3)", 4)
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "metadata count")
        remaining = cur.size - cur.pos
        # A key/value takes >= 13 bytes and a tensor info >= 24: counts beyond that are lies.
        if n_kv * 13 > remaining:
            raise cur.fail(
                f"truncated file or bad count: metadata count {n_kv} cannot fit in the {remaining} bytes left", 16
            )
        if n_tensors * 24 > remaining:
            raise cur.fail(
                f"truncated file or bad count: tensor count {n_tensors} cannot fit in the {remaining} bytes left", 8
            )
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string("metadata key", MAX_KEY_LENGTH)
            vtype = cur.unpack("<I", f"type of '{key}'")
            etype = (
                struct.unpack_from("<I", self.map, cur.pos)[0] if vtype == _ARRAY and cur.pos + 4 <= cur.size else None
            )
            value = cur.value(vtype, f"value of '{key}'")
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key '{key}'", start)
            self.metadata[key] = value
            self.value_types[key] = (vtype, etype)
        infos = []
        seen: set[str] = set()
        for _ in range(n_tensors):
            start = cur.pos
            name = cur.string("tensor name", MAX_KEY_LENGTH)
            if name in seen:
                raise cur.fail(f"duplicate tensor '{name}'", start)
            seen.add(name)
            n_dims = cur.unpack("<I", f"dimension count of '{name}'")
            if n_dims == 0 or n_dims > MAX_DIMS:
                raise cur.fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)", start)
            dims = [cur.unpack("<Q", f"dimensions of '{name}'") for _ in range(n_dims)]
            raw_type = cur.unpack("<I", f"type of '{name}'")
            rel = cur.unpack("<Q", f"data offset of '{name}'")
            infos.append((start, name, dims, raw_type, rel))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-cur.pos // alignment) * alignment
        for start, name, dims, raw_type, rel in infos:
            self.tensors.append(self._tensor(cur, start, name, dims, raw_type, rel, data_start, alignment, index))

    def _tensor(
        self,
        cur: _Cursor,
        start: int,
        name: str,
        dims: list[int],
        raw_type: int,
        rel: int,
        data_start: int,
        alignment: int,
        index: int,
    ) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise cur.fail(f"tensor '{name}' has unknown quant type id {raw_type}", start) from None
        if qtype not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor '{name}' has quant type {qtype.name} with no known block size", start)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise cur.fail(
                f"tensor '{name}' row length {dims[0]} is not a multiple of the {qtype.name} block ({block})",
                start,
            )
        n_elements = 1
        for d in dims:
            n_elements *= d
        n_bytes = n_elements // block * type_size
        offset = data_start + rel
        if offset + n_bytes > cur.size:
            raise cur.fail(
                f"tensor '{name}' data ({n_bytes} bytes at offset {offset}) runs past the end of the file "
                f"({cur.size} bytes)",
                start,
            )
        if rel % alignment:
            raise cur.fail(f"tensor '{name}' data offset {rel} is not aligned", start)
        return TensorInfo(name, qtype, tuple(int(d) for d in reversed(dims)), n_bytes, offset, index)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            # A tensor view still points into the map; the OS unmaps it when the last one dies.
            logger.debug("map of %s still referenced; left to the garbage collector", self.path)


def split_paths(path: Path) -> list[Path]:
    """All shards of a split model `name-00001-of-0000N.gguf`, or just `[path]`."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    if count < 1:
        raise GGUFError(f"{path}: split count in the file name is 0")
    paths = [path.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise GGUFError(f"{path}: split model is missing {', '.join(missing)}")
    return paths


class GGUFFile(Mapping[str, TensorInfo]):
    """A GGUF model (one file or all shards of a split one): metadata and tensors.

    Acts as a read-only mapping from tensor name to `TensorInfo`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._shards: list[_Shard] = []
        self._prefault: Prefault | None = None
        try:
            for i, p in enumerate(split_paths(self.path)):
                self._shards.append(_Shard(p, i))
        except BaseException:
            self.close()
            raise
        self.metadata: dict[str, Any] = dict(self._shards[0].metadata)
        self.value_types = dict(self._shards[0].value_types)
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards:
            for t in shard.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"{shard.path}: tensor '{t.name}' appears in two shards")
                self.tensors[t.name] = t
        self._check_split()
        logger.debug("opened %s: %d tensors, %d keys", self.path, len(self.tensors), len(self.metadata))

    def _check_split(self) -> None:
        declared = self.metadata.get("split.count")
        if declared is not None and int(declared) != len(self._shards):
            raise GGUFError(f"{self.path}: metadata split.count={declared} but {len(self._shards)} file(s) were found")
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise GGUFError(
                f"{self.path}: split.tensors.count={expected} but the shards hold {len(self.tensors)} tensors"
            )

    # Mapping interface over tensors.
    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def file_size(self) -> int:
        return sum(len(s.map) for s in self._shards)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: key general.architecture: missing or not a string")
        return arch

    def tensor_data(self, name: str) -> np.ndarray:
        """A zero-copy uint8 view of a tensor's bytes, shaped [..., row_bytes]."""
        t = self.tensors[name]
        buf = self._shards[t.shard].map
        flat = np.frombuffer(buf, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        return flat.reshape(*t.shape[:-1], t.row_bytes)

    def shard_path(self, shard: int) -> Path:
        """The file that holds shard `shard` (TensorInfo.shard) of the model."""
        return self._shards[shard].path

    def layer_tensors(self, layers: range) -> set[str]:
        """The names of the tensors of blocks `layers` (`blk.N.*`), and, where the range starts at layer 0,
        of the tensors outside any block (embedding, output norm and head): what one stage of a model
        split by layers runs."""
        out = set()
        for name in self.tensors:
            block = block_index(name)
            if (block is None and layers.start == 0) or (block is not None and block in layers):
                out.add(name)
        return out

    def prefault(self, tensors: Iterable[str] | None = None) -> Prefault:
        """Map every page of the file(s) into this process on a background thread (see prefault); stopped at
        close. `tensors`: only the pages of these tensors (a split model's rank maps its own layers)."""
        if self._prefault is None:
            spans: list[list[tuple[int, int]]] | None = None
            if tensors is not None:
                spans = [[] for _ in self._shards]
                for t in sorted((self.tensors[n] for n in tensors), key=lambda t: (t.shard, t.offset)):
                    own = spans[t.shard]
                    if own and own[-1][0] + own[-1][1] >= t.offset:  # touching or overlapping: one stretch
                        own[-1] = (own[-1][0], max(own[-1][1], t.offset + t.n_bytes - own[-1][0]))
                    else:
                        own.append((t.offset, t.n_bytes))
            self._prefault = Prefault([s.map for s in self._shards], self.path.name, spans)
        return self._prefault

    @property
    def size(self) -> int:
        """Bytes of the file(s)."""
        return sum(len(s.map) for s in self._shards)

    def close(self) -> None:
        if self._prefault is not None:
            self._prefault.close()
            self._prefault = None
        for s in self._shards:
            s.close()
        self._shards = []

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def copy_metadata(src: GGUFFile, w: GGUFWriter, arch: str, skip: Collection[str] = ()) -> None:
    """Every key of `src` into a writer for architecture `arch`, with its own value type; the
    source architecture's keys are renamed to `arch`'s. The writer sets general.architecture;
    split.* keys describe the source's shards and are dropped, as are the keys in `skip`."""
    prefix = src.architecture + "."
    for key, value in src.metadata.items():
        if key == "general.architecture" or key in skip or key.startswith("split."):
            continue
        vtype, etype = src.value_types[key]
        name = arch + "." + key[len(prefix) :] if key.startswith(prefix) else key
        if vtype == GGUFValueType.ARRAY:
            sub = GGUFValueType(etype) if etype is not None else None
            w.add_key_value(name, list(value), GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(name, value, GGUFValueType(vtype))
