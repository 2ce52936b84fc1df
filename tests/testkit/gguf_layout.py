"""Where the fields of a (valid) GGUF file sit, so a fuzzer can aim its mutations at them."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# value type id -> fixed size in bytes (8 = string and 9 = array are variable)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class Layout:
    counts: list[int] = field(default_factory=list)  # offsets of u64 counts: tensors, kvs, array lengths
    lengths: list[int] = field(default_factory=list)  # offsets of u64 string lengths
    types: list[int] = field(default_factory=list)  # offsets of u32 value types and tensor types
    keys: list[tuple[int, int]] = field(default_factory=list)  # (offset of the key bytes, length)
    dims: list[int] = field(default_factory=list)  # offsets of u64 tensor dims
    tensor_offsets: list[int] = field(default_factory=list)  # offsets of u64 tensor data offsets
    header_end: int = 0


def layout(data: bytes) -> Layout:
    out = Layout()
    pos = 8
    out.counts += [pos, pos + 8]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def string() -> tuple[int, int]:
        nonlocal pos
        out.lengths.append(pos)
        (n,) = struct.unpack_from("<Q", data, pos)
        start = pos + 8
        pos = start + n
        return start, n

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            out.types.append(pos)
            (inner,) = struct.unpack_from("<I", data, pos)
            out.counts.append(pos + 4)
            (n,) = struct.unpack_from("<Q", data, pos + 4)
            pos += 12
            if inner in _SIZES:
                pos += n * _SIZES[inner]
            else:
                for _ in range(n):
                    value(inner)
        else:
            pos += _SIZES[vtype]

    for _ in range(n_kv):
        out.keys.append(string())
        out.types.append(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        value(vtype)
    for _ in range(n_tensors):
        string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4
        out.dims += [pos + 8 * i for i in range(n_dims)]
        pos += 8 * n_dims
        out.types.append(pos)
        pos += 4
        out.tensor_offsets.append(pos)
        pos += 8
    out.header_end = pos
    return out
