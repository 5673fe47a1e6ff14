"""Selection on secrets: reductions to an extremum and sorting.

`cummax`/`cummin`/`cumprod`: a prefix scan of ceil(log2 n) levels over the whole axis.

`reduce_max`/`min` and `argmax`/`argmin` over an axis: a tournament of ceil(log2 n) levels,
each one comparison and one selection (11 rounds per level); ties keep the lower index, as
numpy does.

`sort` (one or several operands, any number of keys; `jnp.sort`, `argsort`, `lexsort`,
`median`, `quantile`) and `top_k`: Batcher's bitonic sorting network (Batcher, "Sorting
networks and their applications", AFIPS 1968), data-oblivious as SPU's and CrypTen's sorts
are: the axis is padded to m = 2^ceil(log2 n) with copies of the largest key, then
log2(m)(log2(m) + 1)/2 layers each run m/2 compare-exchanges, one comparison (lexicographic
over the keys, one comparison and one equality more per extra key) and one selection per
operand: 11 rounds a layer for one key. With operands beyond the keys (argsort) the original
position is one more key, so equal keys keep their order (stable, as JAX sorts). The layers
are one loop of the share program (its body traced and compiled once), not unrolled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.comparison import below_arith
from mpplug.mpc.secret import Secret, Value, is_float

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


def reduce_extremum(
    self: Interpreter, shares: Shares, axis: int, largest: bool, with_index: bool, dtype: Any
) -> tuple[Shares, Shares | None]:
    """Tournament over `axis`: ceil(log2 n) levels of one comparison and one selection."""
    x = jnp.moveaxis(shares, axis + 1, -1)
    n = x.shape[-1]
    index = (
        self.protocol.lift(self.ctx, jnp.broadcast_to(jnp.arange(n, dtype=jnp.uint64), x.shape[1:]))
        if with_index
        else None
    )
    while n > 1:
        half = n // 2
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]  # neighbours: ties keep a
        bit = below_arith(self, a, b, dtype) if largest else below_arith(self, b, a, dtype)
        if index is not None:
            ia, ib = index[..., 0 : 2 * half : 2], index[..., 1 : 2 * half : 2]
            chosen = self.protocol.mul(
                self.ctx, jnp.stack([bit, bit], 1), jnp.stack([b - a, ib - ia], 1)
            )
            merged, merged_index = a + chosen[:, 0], ia + chosen[:, 1]
            index = jnp.concatenate([merged_index, index[..., 2 * half :]], axis=-1)
        else:
            merged = a + self.protocol.mul(self.ctx, bit, b - a)
        x = jnp.concatenate([merged, x[..., 2 * half :]], axis=-1)
        n = x.shape[-1]
    return x[..., 0], (None if index is None else index[..., 0])


@rule("reduce_max", "reduce_min")
def _reduce_max(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x = self.arith(values[0], values[0].dtype)
    for axis in sorted(eqn.params["axes"], reverse=True):
        largest = eqn.primitive.name == "reduce_max"
        x, _ = reduce_extremum(self, x, axis, largest, False, values[0].dtype)
    return self.out(eqn, x)


@rule("argmax", "argmin")
def _argmax(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (axis,) = eqn.params["axes"]
    x = self.arith(values[0], values[0].dtype)
    largest = eqn.primitive.name == "argmax"
    _, index = reduce_extremum(self, x, axis, largest, True, values[0].dtype)
    assert index is not None
    return self.out(eqn, index)


@rule("cummax", "cummin", "cumprod")
def _cumulative(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """Running max, min or product along an axis: Hillis and Steele's prefix scan, ceil(log2
    n) levels, each one comparison and selection (or one product) over the whole axis."""
    (x,) = values
    axis, reverse = int(eqn.params["axis"]), bool(eqn.params["reverse"])
    name = eqn.primitive.name
    shares = jnp.moveaxis(self.arith(x, x.dtype), axis + 1, -1)
    if reverse:
        shares = jnp.flip(shares, -1)
    bits = self.ctx.frac_bits if is_float(x.dtype) else 0
    step = 1
    while step < shares.shape[-1]:
        prev, cur = shares[..., :-step], shares[..., step:]
        if name == "cumprod":
            combined = self.protocol.mul(self.ctx, prev, cur, bits)
        else:
            earlier = (
                below_arith(self, cur, prev, x.dtype)
                if name == "cummax"
                else below_arith(self, prev, cur, x.dtype)
            )
            combined = cur + self.protocol.mul(self.ctx, earlier, prev - cur)
        shares = jnp.concatenate([shares[..., :step], combined], axis=-1)
        step *= 2
    if reverse:
        shares = jnp.flip(shares, -1)
    return self.out(eqn, jnp.moveaxis(shares, -1, axis + 1))


@rule("sort")
def _sort(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Value]:
    params = eqn.params
    network = _bitonic(len(values), int(params["num_keys"]), int(params["dimension"]))
    return _eval_as(self, network, eqn, values)


@rule("top_k")
def _top_k(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Value]:
    """The k largest along the last axis, largest first, equal values in index order: a
    stable sort of the negated values beside their positions, its first k."""
    k = int(eqn.params["k"])
    axis = int(eqn.params.get("axis", -1))

    def top(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = jnp.moveaxis(x, axis, -1)
        position = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        keys, order = lax.sort((-x, position), dimension=x.ndim - 1, num_keys=1)
        return jnp.moveaxis(-keys[..., :k], -1, axis), jnp.moveaxis(order[..., :k], -1, axis)

    return _eval_as(self, top, eqn, values)


def _eval_as(
    self: Interpreter, fn: Callable[..., Any], eqn: JaxprEqn, values: list[Value]
) -> list[Value] | Value:
    """Interpret `fn` (plain JAX made of primitives with rules) in place of `eqn`."""
    outs = self.eval_as(fn, values)
    return outs if eqn.primitive.multiple_results else outs[0]


def _layers(m: int) -> np.ndarray:
    """(j, k, log2 j) of each layer of a bitonic network over m = 2^p elements."""
    rows = []
    k = 2
    while k <= m:
        j = k // 2
        while j >= 1:
            rows.append((j, k, j.bit_length() - 1))
            j //= 2
        k *= 2
    return np.asarray(rows, np.int32)


def _bitonic(count: int, num_keys: int, dimension: int) -> Callable[..., tuple[jax.Array, ...]]:
    """`lax.sort(operands, dimension, num_keys)` as a bitonic network in plain JAX."""

    def network(*operands: jax.Array) -> tuple[jax.Array, ...]:
        flags = [o.dtype == jnp.bool_ for o in operands]  # bools sort as 0 and 1
        ops = [jnp.moveaxis(o, dimension, -1) for o in operands]
        ops = [o.astype(jnp.int32) if flag else o for o, flag in zip(ops, flags, strict=True)]
        n = ops[0].shape[-1]
        if n < 2:
            return tuple(operands)
        keys = num_keys
        if count > num_keys:  # positions as a last key: stable, and pads stay behind
            ops.insert(keys, lax.broadcasted_iota(jnp.int32, ops[0].shape, ops[0].ndim - 1))
            keys += 1
        m = 1 << (n - 1).bit_length()
        if m > n:
            ops = [_pad(o, m, i < keys) for i, o in enumerate(ops)]
        table = jnp.asarray(_layers(m))
        half = jnp.arange(m // 2, dtype=jnp.int32)
        whole = jnp.arange(m, dtype=jnp.int32)

        def layer(t: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            j, k, q = table[t, 0], table[t, 1], table[t, 2]
            lo = ((half >> q) << (q + 1)) | (half & (j - 1))
            hi = lo | j
            up = (lo & k) == 0
            a = [jnp.take(o, lo, axis=-1, mode="clip") for o in state]
            b = [jnp.take(o, hi, axis=-1, mode="clip") for o in state]
            first = [jnp.where(up, x, y) for x, y in zip(a[:keys], b[:keys], strict=True)]
            second = [jnp.where(up, y, x) for x, y in zip(a[:keys], b[:keys], strict=True)]
            swap = _less(second, first)
            out = []
            for x, y in zip(a, b, strict=True):
                low = jnp.where(swap, y, x)
                merged = jnp.concatenate([low, x + y - low], axis=-1)
                packed = ((whole >> (q + 1)) << q) | (whole & (j - 1))
                back = jnp.where((whole & j) == 0, packed, m // 2 + packed)
                out.append(jnp.take(merged, back, axis=-1, mode="clip"))
            return tuple(out)

        ops = list(lax.fori_loop(0, len(_layers(m)), layer, tuple(ops)))
        if count > num_keys:
            del ops[num_keys]
        ops = [o.astype(jnp.bool_) if flag else o for o, flag in zip(ops, flags, strict=True)]
        return tuple(jnp.moveaxis(o[..., :n], -1, dimension) for o in ops)

    return network


def _pad(x: jax.Array, m: int, key: bool) -> jax.Array:
    """`x` padded along its last axis to m: keys with their largest value (never ahead of a
    real element once positions break ties), other operands with zeros."""
    fill = jnp.max(x, axis=-1, keepdims=True) if key else jnp.zeros((*x.shape[:-1], 1), x.dtype)
    return jnp.concatenate([x, jnp.broadcast_to(fill, (*x.shape[:-1], m - x.shape[-1]))], -1)


def _less(a: list[jax.Array], b: list[jax.Array]) -> jax.Array:
    """Lexicographic a < b over lists of keys."""
    below = a[-1] < b[-1]
    for x, y in zip(reversed(a[:-1]), reversed(b[:-1]), strict=True):
        below = (x < y) | ((x == y) & below)
    return below
