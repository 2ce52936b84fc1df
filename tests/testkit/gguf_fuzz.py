"""Mutations of a valid GGUF file: the kinds of damage downloads and hostile files bring."""

from __future__ import annotations

import random
import struct

from .gguf_layout import Layout

HUGE = (2**63 - 1, 2**64 - 1, 2**40, 2**32, 0xFFFFFFFF, 10**12)
KINDS = ("truncate", "bitflip", "count", "strlen", "type", "dim", "tensor_offset", "non_utf8", "dup_key", "shape")


def mutate(data: bytes, lay: Layout, rng: random.Random, kind: str) -> bytes:
    b = bytearray(data)
    if kind == "truncate":
        return bytes(b[: rng.randrange(0, len(b))])
    if kind == "bitflip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(0, lay.header_end)
            b[i] ^= 1 << rng.randrange(8)
    elif kind == "count":
        struct.pack_into("<Q", b, rng.choice(lay.counts), rng.choice(HUGE))
    elif kind == "strlen":
        struct.pack_into("<Q", b, rng.choice(lay.lengths), rng.choice((*HUGE, len(b))))
    elif kind == "type":
        struct.pack_into("<I", b, rng.choice(lay.types), rng.choice((13, 99, 2**31, 2**32 - 1, 8, 9, 4)))
    elif kind == "dim":
        struct.pack_into("<Q", b, rng.choice(lay.dims), rng.choice((*HUGE, 0, 3, 31)))
    elif kind == "tensor_offset":
        struct.pack_into("<Q", b, rng.choice(lay.tensor_offsets), rng.choice((*HUGE, len(b), 1, 17)))
    elif kind == "non_utf8":
        start, n = rng.choice(lay.keys)
        if n:
            b[start + rng.randrange(n)] = rng.choice((0xFF, 0xC0, 0x80, 0xED))
    elif kind == "dup_key":
        (s1, n1), (s2, n2) = rng.sample(lay.keys, 2)
        if n1 == n2:
            b[s2 : s2 + n2] = b[s1 : s1 + n1]
        else:  # same effect on differently sized keys: clobber one with a prefix-padded copy
            b[s2 : s2 + n2] = (b[s1 : s1 + n1] * (n2 // max(n1, 1) + 1))[:n2]
    elif kind == "shape":
        # Swap two dims of one tensor: the byte size may no longer match its row length.
        i = rng.randrange(len(lay.dims) - 1)
        a, c = lay.dims[i], lay.dims[i + 1]
        b[a : a + 8], b[c : c + 8] = b[c : c + 8], b[a : a + 8]
    return bytes(b)
