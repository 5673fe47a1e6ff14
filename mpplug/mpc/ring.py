"""Arithmetic on the ring Z_2^64 as JAX uint64 arrays: fixed-point encoding, arithmetic
shifts and exact ring matrix products and convolutions (XLA has no fast uint64 dot, so they
go through f64)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
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


def encode(x: Any, frac_bits: int) -> Any:
    """Reals in fixed point: round(x * 2^frac_bits) in two's complement, clamped to
    +-2^62 (values beyond, such as +-inf, become the extremes); a public NaN (a branch
    `jnp.median` or `nan*` functions select away) encodes as 0.

    Every step is exact (a product by a power of two, rounding to an integer, a clamp), so
    a value known while tracing (a constant) is encoded by numpy: its bits are XLA's, and
    no XLA computation is compiled for it. A traced one is encoded with `lax`, not `jnp`,
    whose functions are traced anew on their first call in a process."""
    if not isinstance(x, jax.core.Tracer):
        with np.errstate(over="ignore", invalid="ignore"):
            real = np.asarray(x, np.float64)
            scaled = np.rint(np.where(np.isnan(real), 0.0, real) * (2.0**frac_bits))
            scaled = np.clip(scaled, -ENCODE_LIMIT, ENCODE_LIMIT - 1024.0)
            return scaled.astype(np.int64).astype(np.uint64)
    traced = lax.convert_element_type(x, jnp.float64)
    traced = lax.select(lax.ne(traced, traced), lax.full_like(traced, 0.0), traced)
    rounded = lax.round(
        lax.mul(traced, np.float64(2.0**frac_bits)), lax.RoundingMethod.TO_NEAREST_EVEN
    )
    rounded = lax.clamp(np.float64(-ENCODE_LIMIT), rounded, np.float64(ENCODE_LIMIT - 1024.0))
    return lax.convert_element_type(lax.convert_element_type(rounded, jnp.int64), RING)


def decode(x: jnp.ndarray, frac_bits: int, dtype: Any) -> jnp.ndarray:
    """Ring elements read as signed fixed point, as `dtype` reals."""
    real = lax.convert_element_type(lax.convert_element_type(x, jnp.int64), jnp.float64)
    return lax.convert_element_type(lax.mul(real, np.float64(2.0**-frac_bits)), dtype)


@dataclass(frozen=True)
class Encoding:
    """How an owner's values become ring elements: reals in fixed point with `frac_bits`
    fraction bits, those with |v| >= `limit` taken as 0 (a computation that reads them fails
    on the owner's range check first); integers and bools (`frac_bits` None) as they are.
    Equal encodings compute the same, so what is traced from one is kept for the other."""

    frac_bits: int | None = None
    limit: float | None = None

    def __call__(self, v: Any) -> jnp.ndarray:
        if self.frac_bits is None:
            return to_ring(v)
        if self.limit is not None:  # a power of two: compared exactly in any float type
            real = lax.convert_element_type(v, jnp.float64)
            inside = lax.lt(lax.abs(real), np.float64(self.limit))
            v = lax.select(inside, real, lax.full_like(real, 0.0))
        return encode(v, self.frac_bits)


@dataclass(frozen=True)
class Decoding:
    """How opened ring elements become `dtype` values: bit 0 of boolean shares' value, reals
    read as fixed point with `frac_bits` fraction bits, bools as nonzero, integers wrapped to
    their width."""

    dtype: np.dtype[Any]
    frac_bits: int
    boolean: bool = False

    def __call__(self, v: Any) -> jnp.ndarray:
        if self.boolean:
            return (v & np.uint64(1)).astype(self.dtype)
        if jnp.issubdtype(self.dtype, jnp.floating):
            return decode(v, self.frac_bits, self.dtype)
        if self.dtype == np.bool_:
            return v != 0
        return v.astype(jnp.int64).astype(self.dtype)


def arshift(x: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Arithmetic right shift of ring elements read as signed."""
    return (x.astype(jnp.int64) >> np.int64(bits)).astype(RING)


def _chunk_bits(contracted: int) -> int:
    """The widest chunk whose products, summed `contracted` times, stay exact in f64."""
    return max(1, (_F64_EXACT_BITS - max(0, math.ceil(math.log2(max(contracted, 1))))) // 2)


def dot_general(a: jnp.ndarray, b: jnp.ndarray, dimension_numbers: Any) -> jnp.ndarray:
    """`lax.dot_general` of uint64 arrays, exact mod 2^64."""
    (contract_a, _), _ = dimension_numbers
    contracted = math.prod(a.shape[d] for d in contract_a)

    def product(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
        return lax.dot_general(x, y, dimension_numbers, precision=lax.Precision.HIGHEST)

    return exact_bilinear(a, b, product, contracted)


def conv(a: jnp.ndarray, b: jnp.ndarray, **params: Any) -> jnp.ndarray:
    """`lax.conv_general_dilated` (its primitive's parameters) of uint64 arrays, exact mod 2^64:
    each output sums the kernel's input features times its window."""
    rhs_spec = params["dimension_numbers"].rhs_spec
    contracted = b.shape[rhs_spec[1]] * math.prod(b.shape[d] for d in rhs_spec[2:])
    params = {**params, "precision": lax.Precision.HIGHEST, "preferred_element_type": None}

    def product(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
        return lax.conv_general_dilated_p.bind(x, y, **params)

    return exact_bilinear(a, b, product, contracted)


def exact_bilinear(
    a: jnp.ndarray,
    b: jnp.ndarray,
    product: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray],
    contracted: int,
) -> jnp.ndarray:
    """A bilinear `product` (a matmul, a convolution) of uint64 arrays, exact mod 2^64, each of
    whose outputs sums at most `contracted` elementwise products.

    Operands are split into c-bit chunks with 2c + log2(K) <= 53, so every f64 partial product
    sum is an exact integer; only chunk pairs whose shift stays below 64 bits are multiplied.
    """
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
            exact = product(a_chunks[i], b_chunks[shift - i]).astype(RING)
            part = exact if part is None else part + exact
        assert part is not None
        shifted = part << np.uint64(shift * width)
        total = shifted if total is None else total + shifted
    assert total is not None
    return total
