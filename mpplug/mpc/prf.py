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
import numpy as np
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
"""`prf(key, role, stream=s, shape=..., roles=..., pick=...)`: uint64 words pseudorandom under
`key` (uint32[8]; with `pick`, row 0 of a uint32[2, 8] at the role `pick` and row 1 at any
other); `roles` (None: every role) are the party roles that use them, and a party whose
`role` is not among them may get anything (it computes nothing for them)."""


@prf_p.def_abstract_eval
def _prf_abstract(key: Any, role: Any, *, shape: tuple[int, ...], **params: Any) -> Any:
    return jax.core.ShapedArray(shape, jnp.uint64)


@prf_p.def_impl
def _prf_impl(key: Any, role: Any, **params: Any) -> Any:
    raise RuntimeError("mpc prf runs only inside a traced share program (mp.mpc.run)")


def prf(
    key: jnp.ndarray,
    stream: int,
    shape: Sequence[int],
    *,
    role: jnp.ndarray | None = None,
    roles: Sequence[int] | None = None,
    pick: int | None = None,
) -> jnp.ndarray:
    """uint64 words of `shape`, pseudorandom under the secret `key` (uint32[8]); `stream` (a
    static int below 2^64, never reused with one key) names the stream. Inside a share
    program, `roles` names the roles that use the words and `role` is this party's: the
    others need not compute them. With `pick`, `key` is uint32[2, 8] and the stream's key is
    its row 0 at the party whose role is `pick`, its row 1 at the others (chosen where the
    run's keys are gathered, not in the share program)."""
    where = jnp.int32(0) if role is None else role
    return prf_p.bind(
        key,
        where,
        stream=int(stream),
        shape=tuple(int(d) for d in shape),
        roles=None if roles is None else tuple(sorted(set(roles))),
        pick=None if pick is None else int(pick),
    )


def picked_row(ops: Any, keys: Any, role: Any, pick: int) -> Any:
    """Row 0 of `keys` (uint32[2, 8]) where `role` (0, 1, 2, or past them) is `pick`, else
    row 1, with the calls `ops` makes (`lax`, or what stands in for it)."""
    rows = np.array([0 if r == pick else 1 for r in range(4)], np.int32)
    at = ops.clamp(np.int32(0), ops.convert_element_type(role, jnp.int32), np.int32(3))
    row = ops.dynamic_index_in_dim(rows, at, keepdims=False)
    return ops.dynamic_index_in_dim(keys, row, keepdims=False)
