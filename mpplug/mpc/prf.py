"""The pseudorandom function behind all correlated randomness, as a share program sees it.

`prf(key, stream, shape)` names uint64 words of ChaCha20 stream `stream` under a 256-bit key;
it is a primitive with no JAX implementation: `rounds` draws every stream of a run with one
`mpplug.keystream` call (OpenSSL's ChaCha20, see `mpplug.kernels.keystream`) and each round
reads its streams from that buffer with `stream_view`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive

from mpplug.kernels.keystream import BLOCK_WORDS_64

KEY_WORDS = 8


def blocks_for(shape: Sequence[int]) -> int:
    """Keystream blocks (eight uint64 words each) a stream of `shape` takes."""
    return max(1, -(-math.prod(shape) // BLOCK_WORDS_64))


def stream_view(
    words: jnp.ndarray, start: Any, shape: Sequence[int], ops: Any = lax
) -> jnp.ndarray:
    """The uint64 words of `shape` from a keystream buffer (`mpplug.keystream`'s uint64
    words) whose stream starts at word `start` (an int, or an int32 computed at run time).
    `ops` makes the calls: `lax`, or what stands in for it (`emit`)."""
    # lax, not jnp: a program draws thousands of streams, and jnp's indexing costs 10x to trace
    size = math.prod(shape)
    if isinstance(start, int):
        flat = ops.slice(words, (start,), (start + size,))
    else:
        flat = ops.dynamic_slice_in_dim(words, start, size, axis=0)
    return ops.reshape(flat, tuple(shape))


prf_p = Primitive("mpc_prf")
"""`prf(key, role, stream=s, shape=..., roles=...)`: uint64 words pseudorandom under `key`
(uint32[8]); `roles` (None: every role) are the party roles that use them, and a party whose
`role` is not among them may get anything (it computes nothing for them)."""


@prf_p.def_abstract_eval
def _prf_abstract(
    key: Any, role: Any, *, stream: int, shape: tuple[int, ...], roles: tuple[int, ...] | None
) -> Any:
    return jax.core.ShapedArray(shape, jnp.uint64)


@prf_p.def_impl
def _prf_impl(
    key: Any, role: Any, *, stream: int, shape: tuple[int, ...], roles: tuple[int, ...] | None
) -> Any:
    raise RuntimeError("mpc prf runs only inside a traced share program (mp.mpc.run)")


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
