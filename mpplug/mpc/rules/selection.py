"""Selection on secrets: reductions to an extremum and sorting.

`cummax`/`cummin`/`cumprod`: a prefix scan of ceil(log2 n) levels over the whole axis.

`reduce_max`/`min` and `argmax`/`argmin` over an axis: a tournament of ceil(log2 n) levels,
each one comparison and one selection (11 rounds per level); ties keep the lower index, as
numpy does.

`sort` of one secret key (not a 64-bit integer) over at least `quicksort.SMALLEST` elements:
a secret shuffle, then a quicksort whose comparisons are opened (see `mpplug.mpc.quicksort`).

Other sorts (several keys, 64-bit keys, short ones, or inside a loop's body, where the share
program holds no loop of its own; `jnp.sort`, `argsort`, `lexsort`, `median`, `quantile`) and
`top_k`: Batcher's odd-even merge sorting network (Batcher,
"Sorting networks and their applications", AFIPS 1968), data-oblivious as SPU's and CrypTen's
sorting networks are, over exactly n elements: the network for m = 2^ceil(log2 n) with every
comparator that reaches past n dropped (no padding: each comparator sends the smaller value to
the lower position, so virtual +inf elements past n would never move). log2(m)(log2(m) + 1)/2
layers each run at most n/2 compare-exchanges (one loop of the share program: a fixed n // 2
slots a layer, empty slots left as they are), each one comparison (lexicographic over the
keys, one comparison and one equality more per extra key) and one selection per operand:
11 rounds a layer for one key. With operands beyond the keys (argsort) the original position
is one more key, so equal keys keep their order (stable, as JAX sorts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from mpplug.mpc import quicksort
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.comparison import below_arith
from mpplug.mpc.secret import Secret, Value, is_float, is_narrow_int

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
def _sort(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Value] | Value:
    params = eqn.params
    num_keys, dimension = int(params["num_keys"]), int(params["dimension"])
    if quicksort.applies(self, values, num_keys, dimension):
        outs = quicksort.sort(self, values, dimension)
        return outs if eqn.primitive.multiple_results else outs[0]
    network = _network(len(values), num_keys, dimension)
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


def _layers(n: int) -> np.ndarray:
    """(log2 p, log2 k) of each layer of Batcher's odd-even merge sort over n elements: for
    merges of sorted runs of p = 1, 2, 4, ... (while p < n), comparators at distance
    k = p, p/2, ..., 1."""
    rows = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            rows.append((p.bit_length() - 1, k.bit_length() - 1))
            k //= 2
        p *= 2
    return np.asarray(rows, np.int32)


def _comparators(lp: jax.Array, lk: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's comparators (i, i + k), smaller value to i, as n // 2 slots: each slot's
    lower position, whether the slot holds a comparator, and each position's source in
    [positions, slots' smaller, slots' larger] (public arithmetic on the layer's p, k).

    Before pruning, a layer's lower ends are, in order, k consecutive positions every 2k from
    k mod p, skipping the group that would reach into the next run of 2p: G = max(1, p/k - 1)
    groups a run. Comparators reaching past n are dropped (the virtual ends there hold +inf,
    which never moves as every comparator sends the smaller value down), so the kept ones are
    a prefix of the slots: at most n // 2, as they share no position."""
    half = n // 2
    k = jnp.left_shift(1, lk)
    run = jnp.left_shift(2, lp)  # 2p
    first = k & (run // 2 - 1)  # k mod p: k, or 0 when k = p
    groups = jnp.maximum(1, jnp.right_shift(run // 2, lk) - 1)
    slot = jnp.arange(half, dtype=jnp.int32)
    group = slot >> lk
    lower = lax.div(group, groups) * run + first + 2 * k * lax.rem(group, groups) + (slot & (k - 1))
    kept = lower + k < n

    position = jnp.arange(n, dtype=jnp.int32)

    def slot_of(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(whether x is a kept lower end, its slot)."""
        within = (x & (run - 1)) - first
        group_in_run, offset = lax.div(within, 2 * k), within & (2 * k - 1)
        is_lower = (within >= 0) & (offset < k) & (group_in_run < groups) & (x + k < n)
        return is_lower, (lax.div(x, run) * groups + group_in_run) * k + offset

    is_lower, own = slot_of(position)
    is_upper, partner = slot_of(position - k)
    is_upper = is_upper & (position >= k)
    source = jnp.where(is_lower, n + own, jnp.where(is_upper, n + half + partner, position))
    return lower, kept, source


def _network(count: int, num_keys: int, dimension: int) -> Callable[..., tuple[jax.Array, ...]]:
    """`lax.sort(operands, dimension, num_keys)` as an odd-even merge sorting network in
    plain JAX, its layers one loop."""

    def network(*operands: jax.Array) -> tuple[jax.Array, ...]:
        flags = [o.dtype == jnp.bool_ for o in operands]  # bools sort as 0 and 1
        ops = [jnp.moveaxis(o, dimension, -1) for o in operands]
        ops = [o.astype(jnp.int32) if flag else o for o, flag in zip(ops, flags, strict=True)]
        n = ops[0].shape[-1]
        if n < 2:
            return tuple(operands)
        keys = num_keys
        if count > num_keys:  # positions as a last key: stable
            ops.insert(keys, lax.broadcasted_iota(jnp.int32, ops[0].shape, ops[0].ndim - 1))
            keys += 1
        table = jnp.asarray(_layers(n))

        def layer(t: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            lower, kept, source = _comparators(table[t, 0], table[t, 1], n)
            upper = lower + jnp.left_shift(1, table[t, 1])
            a = [jnp.take(o, lower, axis=-1, mode="clip") for o in state]
            b = [jnp.take(o, upper, axis=-1, mode="clip") for o in state]
            swap = _less(b[:keys], a[:keys])
            out = []
            for o, x, y in zip(state, a, b, strict=True):
                low = jnp.where(swap, jnp.where(kept, y, x), x)  # empty slots keep x: no AND
                # x + y - low saves a product (a public payload is lifted to shares as the
                # loop's carry, so no float sum rounds), but a narrow integer's sum counts as
                # wide and would be wrapped before its next comparison (9 rounds): select it
                high = jnp.where(swap, x, y) if is_narrow_int(o.dtype) else x + y - low
                merged = jnp.concatenate([o, low, high], axis=-1)
                out.append(jnp.take(merged, source, axis=-1, mode="clip"))
            return tuple(out)

        ops = list(lax.fori_loop(0, len(table), layer, tuple(ops)))
        if count > num_keys:
            del ops[num_keys]
        ops = [o.astype(jnp.bool_) if flag else o for o, flag in zip(ops, flags, strict=True)]
        return tuple(jnp.moveaxis(o, -1, dimension) for o in ops)

    return network


def _less(a: list[jax.Array], b: list[jax.Array]) -> jax.Array:
    """Lexicographic a < b over lists of keys."""
    below = a[-1] < b[-1]
    for x, y in zip(reversed(a[:-1]), reversed(b[:-1]), strict=True):
        below = (x < y) | ((x == y) & below)
    return below
