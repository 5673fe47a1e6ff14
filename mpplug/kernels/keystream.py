"""The `mpplug.keystream` kernel: ChaCha20 keystream blocks (RFC 8439) for many streams at
once, from OpenSSL through `cryptography`, so randomness costs no per-program compile.

Threat model: semi-honest parties. Stream s under a 256-bit key k is the ChaCha20 keystream
with nonce (s mod 2^32, s >> 32, "mppl") from block counter 0; ChaCha20 is assumed a PRF
(D. J. Bernstein, "ChaCha, a variant of Salsa20", 2008; RFC 8439), so a party without k sees
uniform words, and parties that hold k compute the same ones.
"""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from mpplug.core import DType, PFunction, TensorType
from mpplug.core.memory import mapped_bytes
from mpplug.errors import InvalidPFunctionError
from mpplug.kernels.runtime import KernelRuntime

KEYSTREAM = "mpplug.keystream"
BLOCK_WORDS = 16
"""32-bit words per ChaCha block (64 bytes)."""
BLOCK_WORDS_64 = BLOCK_WORDS // 2
"""64-bit words per block: the buffer's word j of block b is its words 2j and 2j + 1,
little-endian (word 2j | word 2j+1 << 32)."""
NONCE_TAG = 0x6D70706C
"""The nonce's third word, "mppl"."""
MAX_BLOCKS = 1 << 26
"""At most 4 GiB of keystream in one call."""
ROLE_TYPE = TensorType(DType.INT32, ())
ITERATION_TYPE = TensorType(DType.INT32, ())


def _encryptor(key: bytes, stream: int) -> Any:
    nonce = struct.pack("<IIII", 0, stream & 0xFFFFFFFF, stream >> 32, NONCE_TAG)
    return Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()


def keystream_blocks(key: bytes, stream: int, count: int) -> np.ndarray:
    """uint32[count, 16]: blocks 0..count-1 of stream `stream` under the 32-byte `key`."""
    data = _encryptor(key, stream).update(bytes(64 * count))
    return np.frombuffer(data, "<u4").reshape(count, BLOCK_WORDS)


def stream_offsets(counts: Sequence[int], rows: Sequence[Sequence[int]]) -> np.ndarray:
    """int64[rows, streams]: where each stream starts in a row's buffer, which holds only the
    streams the row chose (a stream not chosen starts where the next one does)."""
    chosen = np.asarray(rows, np.int64) * np.asarray(counts, np.int64)[None, :]
    return np.cumsum(chosen, axis=1) - chosen


def keystream_pfunction(
    streams: Sequence[int],
    counts: Sequence[int],
    rows: Sequence[Sequence[int]],
    stride: int | None = None,
    slack: int = 0,
) -> PFunction:
    """(keys u32[S, 8][, role i32[]][, iteration i32[]]) -> u64[width * 8]: the blocks of the
    streams row `role` chose (1s in `rows[role]`; a role past the last row takes the last),
    stream i's `counts[i]` blocks under key i from its row's offset, laid end to end; the rest
    is zeros (`width` is the widest row's blocks and `slack` more). Without several rows there
    is no role input. With a `stride`, iteration t of a loop draws stream
    `streams[i] + t * stride` in place of `streams[i]` (t >= 0).

    The layout travels packed (a program draws thousands of streams): `streams` as
    little-endian uint64s, `counts` as uint32s, `rows` as one byte (0 or 1) per stream, row
    after row."""
    width = max(sum(c for c, on in zip(counts, row, strict=True) if on) for row in rows) + slack
    ins = [TensorType(DType.UINT32, (len(streams), 8))]
    if len(rows) > 1:
        ins.append(ROLE_TYPE)
    attrs: dict[str, Any] = {
        "streams": np.asarray(streams, "<u8").tobytes(),
        "counts": np.asarray(counts, "<u4").tobytes(),
        "rows": np.asarray(rows, bool).astype(np.uint8).tobytes(),
    }
    if stride is not None:
        ins.append(ITERATION_TYPE)
        attrs["stride"] = int(stride)
    if slack:
        attrs["slack"] = int(slack)
    out = TensorType(DType.UINT64, (width * BLOCK_WORDS_64,))
    return PFunction(KEYSTREAM, "keystream", b"", tuple(ins), (out,), attrs)


def _packed(pfunc: PFunction, name: str, dtype: str) -> np.ndarray:
    value = pfunc.attrs.get(name)
    item = np.dtype(dtype).itemsize
    if not isinstance(value, bytes) or not value or len(value) % item:
        raise InvalidPFunctionError(
            f"{KEYSTREAM}: expected attribute {name!r} to be packed {dtype} values (bytes, a "
            f"non-zero multiple of {item}), got {type(value).__name__} {value!r}"[:300]
        )
    return np.frombuffer(value, dtype)


def _layout(pfunc: PFunction) -> tuple[list[int], list[int], list[list[int]], int, int | None]:
    streams = [int(s) for s in _packed(pfunc, "streams", "<u8")]
    counts = [int(c) for c in _packed(pfunc, "counts", "<u4")]
    stride = pfunc.attrs.get("stride")
    if stride is not None and (
        not isinstance(stride, int) or isinstance(stride, bool) or not 1 <= stride < 2**32
    ):
        raise InvalidPFunctionError(
            f"{KEYSTREAM}: expected attribute 'stride' to be an int in 1..2^32-1, got {stride!r}"[
                :300
            ]
        )
    slack = pfunc.attrs.get("slack", 0)
    if not isinstance(slack, int) or isinstance(slack, bool) or not 0 <= slack <= MAX_BLOCKS:
        raise InvalidPFunctionError(
            f"{KEYSTREAM}: expected attribute 'slack' to be an int in 0..{MAX_BLOCKS}, got "
            f"{slack!r}"[:300]
        )
    flags = _packed(pfunc, "rows", "u1")
    if len(counts) != len(streams) or len(flags) % len(streams) or (flags > 1).any():
        raise InvalidPFunctionError(
            f"{KEYSTREAM}: expected 'counts' to have one entry per stream ({len(streams)}) and "
            f"'rows' to be rows of one 0 or 1 per stream, got {len(counts)} counts and "
            f"{len(flags)} row bytes"
        )
    rows = flags.reshape(-1, len(streams)).astype(int).tolist()
    if any(c < 1 for c in counts):
        raise InvalidPFunctionError(f"{KEYSTREAM}: counts >= 1 expected")
    width = max(sum(c for c, on in zip(counts, r, strict=True) if on) for r in rows) + slack
    expected_ins = (
        (TensorType(DType.UINT32, (len(streams), 8)),)
        + ((ROLE_TYPE,) if len(rows) > 1 else ())
        + ((ITERATION_TYPE,) if stride is not None else ())
    )
    expected_out = (TensorType(DType.UINT64, (width * BLOCK_WORDS_64,)),)
    if pfunc.ins_info != expected_ins or pfunc.outs_info != expected_out:
        raise InvalidPFunctionError(
            f"{KEYSTREAM}: expected {', '.join(map(str, expected_ins))} -> {expected_out[0]}, "
            f"got {pfunc!r}"
        )
    if width > MAX_BLOCKS:
        raise InvalidPFunctionError(
            f"{KEYSTREAM}: {width} blocks asked for, at most {MAX_BLOCKS} in one call"
        )
    return streams, counts, rows, width, stride


def run_keystream(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    streams, counts, rows, width, stride = _layout(pfunc)
    keys = np.asarray(args[0], np.uint32)
    row = min(max(int(args[1]), 0), len(rows) - 1) if len(rows) > 1 else 0
    if stride is not None:
        iteration = int(args[-1])
        if iteration < 0:
            raise InvalidPFunctionError(f"{KEYSTREAM}: expected an iteration >= 0, got {iteration}")
        streams = [s + iteration * stride for s in streams]
        if any(s >= 2**64 for s in streams):
            raise InvalidPFunctionError(f"{KEYSTREAM}: iteration {iteration} runs past stream 2^64")
    chosen = [i for i in range(len(streams)) if rows[row][i]]
    # keystream = ChaCha20 of zeros, written straight into the buffer (one block of slack:
    # a cipher may ask for room for a block more than it writes)
    buffer, out = _buffer(runtime, (width + 1) * 64)
    at = 0
    for i in chosen:
        encryptor = _encryptor(keys[i].astype("<u4").tobytes(), streams[i])
        end = at + 64 * counts[i]
        while at < end:
            step = min(end - at, len(_ZEROS))
            encryptor.update_into(_ZEROS[:step], out.data[at:])
            at += step
    if buffer.written > at:  # what an earlier draw left there; past it, pages never written
        out[at : buffer.written] = 0
    buffer.written = at
    words = out[: width * 64].view("<u8")
    # on the party's device once (on a CPU, aligned memory is taken without a copy): every
    # round that slices the buffer reads it there
    with jax.enable_x64(True):  # uint64 as it is (this thread only)
        return [jax.device_put(words.astype(np.uint64, copy=False), runtime.resolved_device())]


KEPT_BYTES = 256 << 20
"""Keystream buffers a party keeps for its next runs, in bytes (least recently used dropped
first). Fresh memory is paid for page by page when first written, and dearly on a virtual
machine (here, filling 80 MB of a shared mapping took 186 ms at one hour and 60 at another,
of a private one, as drawn now, 44 at the second; ChaCha20 into memory written before, 17 ms),
while a program's next run draws a buffer of the same size (the reciprocal of 100,000
values: about 120 MB a party)."""


class _Buffer:
    """Pages from the OS for one draw's words: zeros until written, each paid for when first
    written, so the part of the buffer a role leaves unwritten costs nothing (a role draws
    fewer streams than the widest). `written` is how far a draw wrote; past it, zeros."""

    def __init__(self, size: int) -> None:
        self.memory = mapped_bytes(size)
        self.written = 0


def _buffer(runtime: KernelRuntime, size: int) -> tuple[_Buffer, np.ndarray]:
    """`size` bytes, page-aligned, and its memory: a buffer this runtime drew into before,
    once nothing refers to it any more (no array made from it is alive, nor a computation
    reading it: JAX lets go of memory it took without a copy only then), else a new one.
    The memory returned marks it taken before another thread can look (runs of two
    programs at one party)."""
    kept = runtime.cache(KEYSTREAM, lambda buffer: buffer.memory.nbytes, KEPT_BYTES)
    with _TAKING:
        buffer = kept.get(size)
        if buffer is None or sys.getrefcount(buffer.memory) > _UNUSED_REFS:
            buffer = _Buffer(size)
            if size <= KEPT_BYTES:  # a bigger one is not kept
                kept.put(size, buffer)
        return buffer, buffer.memory


_TAKING = threading.Lock()


_UNUSED_REFS = 2
"""References to a kept buffer's array that nothing else holds: its `_Buffer`'s and
`sys.getrefcount`'s argument (a view made from it holds one more)."""


_ZEROS = memoryview(bytes(1 << 20))
"""What the cipher encrypts, a MiB (a multiple of the 64-byte block) at a time."""
