"""The pseudorandom function behind all correlated randomness: ChaCha (RFC 8439) in JAX.

`prf(key, stream, shape)` expands a 256-bit key into uint64 words, one stream per number; it
is a primitive so that `rounds` can compute every stream of a program in one batched call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

ROUNDS = 12
"""ChaCha12: the round count of Rust's `rand::StdRng`; RFC 8439's ChaCha20 costs 5/3 as much.
Seven rounds are the most any known attack reaches (Aumasson, "Too Much Crypto", 2019)."""

KEY_WORDS = 8
_SIGMA = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], np.uint32)
_COLUMNS = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
_DIAGONALS = ((0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))
_NONCE_TAG = 0x6D70706C  # "mppl", the nonce's third word
CHUNK = 8192
"""Blocks per loop step (512 KiB of keystream)."""


def _rotl(x: jnp.ndarray, n: int) -> jnp.ndarray:
    return (x << np.uint32(n)) | (x >> np.uint32(32 - n))


def _quarter_round(s: list[jnp.ndarray], a: int, b: int, c: int, d: int) -> None:
    s[a] = s[a] + s[b]
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = s[c] + s[d]
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = s[a] + s[b]
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = s[c] + s[d]
    s[b] = _rotl(s[b] ^ s[c], 7)


def chacha_blocks(
    key: jnp.ndarray, nonce: jnp.ndarray, counter: jnp.ndarray, rounds: int = ROUNDS
) -> jnp.ndarray:
    """ChaCha`rounds` keystream blocks as uint32[16, n] (word-major: row w is word w of every
    block), RFC 8439 layout: per block a key uint32[n, 8], a nonce uint32[n, 3] and a block
    counter uint32[n]. Word-major rows keep XLA's loop free of transposes."""
    n = counter.shape[0]
    initial = [jnp.full((n,), w, jnp.uint32) for w in _SIGMA]
    initial += [key[:, i] for i in range(KEY_WORDS)] + [counter]
    initial += [nonce[:, i] for i in range(3)]

    def double_round(_: Any, words: tuple[jnp.ndarray, ...]) -> tuple[jnp.ndarray, ...]:
        state = list(words)
        for quarter in (*_COLUMNS, *_DIAGONALS):
            _quarter_round(state, *quarter)
        return tuple(state)

    # A rolled loop keeps a PRF call a few dozen HLO ops, so rounds compile quickly.
    state = lax.fori_loop(0, rounds // 2, double_round, tuple(initial))
    return jnp.stack([s + i for s, i in zip(state, initial, strict=True)])


def _blocks(shape: Sequence[int]) -> int:
    return max(1, -(-math.prod(shape) // 8))


def prf_many(
    keys: Sequence[jnp.ndarray], streams: Sequence[int], shapes: Sequence[Sequence[int]]
) -> list[jnp.ndarray]:
    """Several PRF streams in one ChaCha loop, whatever the number of streams.

    Stream s under key k is ChaCha with nonce (s mod 2^32, s >> 32, "mppl") and blocks 0, 1,
    ...; its uint64 words are (word 2j | word 2j+1 << 32) of every block, for j = 0..7 in turn.
    Blocks are made CHUNK at a time so the loop's state stays in cache, and each block's key,
    nonce and counter are computed in the graph (the program does not grow with the data).
    """
    counts = [_blocks(s) for s in shapes]
    starts = np.cumsum([0, *counts])
    chunks = -(-int(starts[-1]) // CHUNK)
    key_table = jnp.stack([k.astype(jnp.uint32) for k in keys])
    nonce_table = jnp.asarray(
        np.array([[s & 0xFFFFFFFF, s >> 32, _NONCE_TAG] for s in streams], np.uint32)
    )
    first_block = jnp.asarray(starts[:-1].astype(np.uint32))

    def chunk(index: jnp.ndarray) -> jnp.ndarray:
        block = index.astype(jnp.uint32) * np.uint32(CHUNK) + jnp.arange(CHUNK, dtype=jnp.uint32)
        owner = jnp.searchsorted(first_block, block, side="right") - 1
        return chacha_blocks(key_table[owner], nonce_table[owner], block - first_block[owner])

    words = lax.map(chunk, jnp.arange(chunks)).astype(jnp.uint64)  # [chunks, 16, CHUNK]
    wide = words[:, 0::2] | (words[:, 1::2] << np.uint64(32))
    wide = jnp.moveaxis(wide, 1, 0).reshape(8, chunks * CHUNK)
    out = []
    for shape, start, count in zip(shapes, starts, counts, strict=False):
        stream = wide[:, start : start + count].reshape(-1)[: math.prod(shape)]
        out.append(stream.reshape(tuple(shape)))
    return out


def compact_offsets(counts: Sequence[int], rows: Sequence[Sequence[bool]]) -> np.ndarray:
    """Where each stream starts in a compact buffer holding only the streams a row chose:
    int32[rows, streams], the running sum of the chosen streams' block counts (a stream not
    chosen takes no blocks and starts where the next one does)."""
    chosen = np.asarray(rows, bool) * np.asarray(counts, np.int64)[None, :]
    starts = np.cumsum(chosen, axis=1) - chosen
    return starts.astype(np.int32)


def prf_compact(
    keys: Sequence[jnp.ndarray],
    streams: Sequence[int],
    offsets: jnp.ndarray,
    total: jnp.ndarray,
    width: int,
) -> jnp.ndarray:
    """The keystream blocks of the streams one row of `compact_offsets` chose, laid out
    compactly: uint32[16, width] (word-major), stream i from block `offsets[i]`, computed
    CHUNK blocks at a time for `total` blocks (a traced count: a party computes only its
    own). Blocks past `total` are zero. One loop, whatever the number of streams."""
    key_table = jnp.stack([k.astype(jnp.uint32) for k in keys])
    nonce_table = jnp.asarray(
        np.array([[s & 0xFFFFFFFF, s >> 32, _NONCE_TAG] for s in streams], np.uint32)
    )
    offsets = offsets.astype(jnp.int32)

    def chunk(index: jnp.ndarray, out: jnp.ndarray) -> jnp.ndarray:
        block = index * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)
        owner = jnp.searchsorted(offsets, block, side="right") - 1
        counter = (block - offsets[owner]).astype(jnp.uint32)
        words = chacha_blocks(key_table[owner], nonce_table[owner], counter)
        return lax.dynamic_update_slice(out, words, (jnp.int32(0), index * CHUNK))

    chunks = (total.astype(jnp.int32) + CHUNK - 1) // CHUNK
    return lax.fori_loop(jnp.int32(0), chunks, chunk, jnp.zeros((16, width), jnp.uint32))


def stream_view(blocks: jnp.ndarray, offset: Any, count: int, shape: Sequence[int]) -> jnp.ndarray:
    """Stream words of `shape` from `prf_compact`'s buffer, its `count` blocks from `offset`:
    the same words `prf_many` gives for that stream."""
    words = lax.dynamic_slice_in_dim(blocks, jnp.asarray(offset, jnp.int32), count, axis=1)
    wide = words[0::2].astype(jnp.uint64) | (words[1::2].astype(jnp.uint64) << np.uint64(32))
    return wide.reshape(-1)[: math.prod(shape)].reshape(tuple(shape))


def blocks_for(shape: Sequence[int]) -> int:
    """Keystream blocks (eight uint64 words each) a stream of `shape` takes."""
    return _blocks(shape)


prf_p = Primitive("mpc_prf")
"""`prf(key, role, stream=s, shape=..., roles=...)`: uint64 words pseudorandom under `key`
(uint32[8]); `roles` (None: every role) are the party roles that use them, and a party whose
`role` is not among them may get anything (the round scheduler skips its ChaCha work)."""


@prf_p.def_abstract_eval
def _prf_abstract(
    key: Any, role: Any, *, stream: int, shape: tuple[int, ...], roles: tuple[int, ...] | None
) -> Any:
    return jax.core.ShapedArray(shape, jnp.uint64)


def _prf_impl(
    key: Any, role: Any, *, stream: int, shape: tuple[int, ...], roles: tuple[int, ...] | None
) -> Any:
    return prf_many([key], [stream], [shape])[0]


prf_p.def_impl(_prf_impl)
mlir.register_lowering(prf_p, mlir.lower_fun(_prf_impl, multiple_results=False))


def prf(
    key: jnp.ndarray,
    stream: int,
    shape: Sequence[int],
    *,
    role: jnp.ndarray | None = None,
    roles: Sequence[int] | None = None,
) -> jnp.ndarray:
    """uint64 words of `shape`, pseudorandom under the secret `key` (uint32[8]); `stream` (a
    static int below 2^64, never reused with one key) names the stream. Inside a share
    program, `roles` names the roles that use the words and `role` is this party's: the
    others need not compute them."""
    where = jnp.int32(0) if role is None else role
    return prf_p.bind(
        key,
        where,
        stream=int(stream),
        shape=tuple(int(d) for d in shape),
        roles=None if roles is None else tuple(sorted(set(roles))),
    )
