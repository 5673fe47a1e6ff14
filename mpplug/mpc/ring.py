"""Arithmetic on the ring Z_2^64 as JAX uint64 arrays: fixed-point encoding, arithmetic
shifts and exact ring matrix products (XLA has no fast uint64 dot, so they go through f64)."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

RING = jnp.uint64
BITS = 64
_F64_EXACT_BITS = 53


def to_ring(x: Any) -> jnp.ndarray:
    """Integers (any width, two's complement) as ring elements."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(RING)
    return x.astype(jnp.int64).astype(RING) if x.dtype != RING else x


ENCODE_LIMIT = 2.0**62
"""Encoded magnitudes are clamped to a quarter of the ring: a public +-inf (softmax's
`initial=-inf`) becomes the largest fixed-point magnitude, still compared exactly."""


def encode(x: Any, frac_bits: int) -> jnp.ndarray:
    """Reals in fixed point: round(x * 2^frac_bits) in two's complement, clamped to
    +-2^62 (values beyond, such as +-inf, become the extremes)."""
    scaled = jnp.round(jnp.asarray(x, jnp.float64) * (2.0**frac_bits))
    scaled = jnp.clip(scaled, -ENCODE_LIMIT, ENCODE_LIMIT - 1024.0)
    return scaled.astype(jnp.int64).astype(RING)


def decode(x: jnp.ndarray, frac_bits: int, dtype: Any) -> jnp.ndarray:
    """Ring elements read as signed fixed point, as `dtype` reals."""
    return (x.astype(jnp.int64).astype(jnp.float64) / (2.0**frac_bits)).astype(dtype)


def arshift(x: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Arithmetic right shift of ring elements read as signed."""
    return (x.astype(jnp.int64) >> np.int64(bits)).astype(RING)


def _chunk_bits(contracted: int) -> int:
    """The widest chunk whose products, summed `contracted` times, stay exact in f64."""
    return max(1, (_F64_EXACT_BITS - max(0, math.ceil(math.log2(max(contracted, 1))))) // 2)


def dot_general(a: jnp.ndarray, b: jnp.ndarray, dimension_numbers: Any) -> jnp.ndarray:
    """`lax.dot_general` of uint64 arrays, exact mod 2^64.

    Operands are split into c-bit chunks with 2c + log2(K) <= 53, so every f64 partial product
    sum is an exact integer; only chunk pairs whose shift stays below 64 bits are multiplied.
    """
    (contract_a, _), _ = dimension_numbers
    contracted = math.prod(a.shape[d] for d in contract_a)
    width = _chunk_bits(contracted)
    count = -(-BITS // width)
    mask = np.uint64((1 << width) - 1)

    def chunk(x: jnp.ndarray, i: int) -> jnp.ndarray:
        return ((x >> np.uint64(i * width)) & mask).astype(jnp.float64)

    a_chunks = [chunk(a, i) for i in range(count)]
    b_chunks = [chunk(b, j) for j in range(count)]
    total = None
    for shift in range(count):
        part = None
        for i in range(shift + 1):
            term = lax.dot_general(
                a_chunks[i],
                b_chunks[shift - i],
                dimension_numbers,
                precision=lax.Precision.HIGHEST,
            )
            exact = term.astype(RING)
            part = exact if part is None else part + exact
        assert part is not None
        shifted = part << np.uint64(shift * width)
        total = shifted if total is None else total + shifted
    assert total is not None
    return total
