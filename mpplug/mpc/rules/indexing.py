"""Reading a table at secret indices: `gather` (`table[i]`, `jnp.take` along one axis,
`jnp.take_along_axis`) and `dynamic_slice` with secret start indices; writing at secret
indices: `scatter` and `scatter-add` of whole rows (`x.at[i].set(v)`, `x.at[i].add(v)`) and
`dynamic_update_slice` with secret starts.

A secret index i into n rows reads sum_r onehot(i)_r * table_r, the one-hot built without
an equality test per row: the low b = ceil(log2 n) bits of i are decomposed (a carry-save and
Kogge-Stone adder over b bits: 2 + ceil(log2 b) rounds), turned arithmetic (3 rounds), and
split into a high and a low half. Each half's one-hot (2^(b/2) entries) is built bit by bit,
one product per entry (b/2 rounds), the table is read as a 2^(b/2) x 2^(b/2) grid: a ring
matrix product with the high one-hot picks a row of the grid (1 round), a product with the low
one-hot and a sum picks the element (1 round). Per index about 2 sqrt(n) + b products instead
of n comparisons (the square-root trick of oblivious lookups; Keller and Scholl, "Efficient,
oblivious data structures for MPC", ASIACRYPT 2014, discuss the same costs). A table row past
n reads 0; an index outside [0, 2^b) reads the row it equals mod 2^b. `take_along_axis`
reads a different row per index: there each index's full one-hot (2^b products) multiplies
its row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc import ring
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.bits import index_digits, one_hot
from mpplug.mpc.secret import UNSUPPORTED_HINT, Secret, Value, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


@rule("gather")
def _gather(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    operand, indices = values
    if not isinstance(indices, Secret):
        return self.structural(eqn, values)
    params = eqn.params
    dims = params["dimension_numbers"]
    if getattr(dims, "operand_batching_dims", ()):
        return self.out(eqn, _along_axis(self, eqn, operand, indices, dims, params["slice_sizes"]))
    axes = _indexed_axes(self, eqn, operand, dims, params["slice_sizes"])
    aval = out_aval(eqn)
    shape = tuple(np.shape(operand)) if not isinstance(operand, Secret) else operand.shape
    bounds = np.asarray([shape[a] for a in axes], np.int32)
    if "CLIP" in str(params["mode"]):
        (indices,) = self.eval_as(lambda v: jnp.clip(v, 0, bounds - 1), [indices])
    (index,) = self.eval_as(lambda v: jnp.sum(v * _strides(bounds), axis=-1), [indices])
    table = _merged(self, operand, axes, aval.dtype)
    rows = read_rows(self, table, 0, self.arith(index, np.int64), aval.dtype)
    batch_rank = len(indices.shape) - 1
    if axes[0] not in dims.collapsed_slice_dims:  # the row's axis kept, of size 1
        rows = jnp.expand_dims(rows, 1 + batch_rank + axes[0])
    rest = list(range(batch_rank, rows.ndim - 1))
    batch = list(range(batch_rank))
    order = [rest.pop(0) if p in dims.offset_dims else batch.pop(0) for p in range(rows.ndim - 1)]
    return self.out(eqn, self.protocol.local(lambda s: jnp.transpose(s, order), rows))


def _strides(bounds: np.ndarray) -> np.ndarray:
    """Each indexed axis's stride in the axes' row-major merge."""
    return np.asarray([int(np.prod(bounds[k + 1 :])) for k in range(len(bounds))], np.int32)


def _merged(self: Interpreter, operand: Value, axes: tuple[int, ...], dtype: Any) -> Value:
    """`operand` with `axes` moved first (in that order) and merged into one: its rows are the
    points those axes index, row-major; the other axes follow in their order."""
    shape = tuple(np.shape(operand)) if not isinstance(operand, Secret) else operand.shape
    order = [*axes, *(d for d in range(len(shape)) if d not in axes)]
    merged = (int(np.prod([shape[a] for a in axes])), *(shape[d] for d in order[len(axes) :]))
    if not isinstance(operand, Secret):
        return jnp.transpose(jnp.asarray(operand), order).reshape(merged)
    moved = self.protocol.local(lambda s: jnp.transpose(s, order).reshape(merged), operand.shares)
    return Secret(moved, merged, np.dtype(dtype))


@rule("dynamic_slice")
def _dynamic_slice(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """Slices along each axis in turn: a public start slices the shares, a secret one (clamped
    into [0, n - size] as lax does) reads `size` consecutive rows by `read_rows`."""
    operand, *starts = values
    if not any(isinstance(s, Secret) for s in starts):
        return self.structural(eqn, values)
    dtype = out_aval(eqn).dtype
    shares = self.arith(operand, dtype)
    for axis, (start, size) in enumerate(zip(starts, eqn.params["slice_sizes"], strict=True)):
        n = shares.shape[1 + axis]
        if isinstance(start, Secret):
            (first,) = self.eval_as(lambda v, n=n, z=size: jnp.clip(v, 0, n - z), [start])
            at = self.arith(first, np.int64)[:, None] + self.protocol.lift(
                self.ctx, jnp.arange(size, dtype=ring.RING)
            )
            table = Secret(shares, tuple(shares.shape[1:]), np.dtype(dtype))
            rows = read_rows(self, table, axis, at, dtype)  # (2, size, *other axes)
            shares = jnp.moveaxis(rows, 1, 1 + axis)
        else:
            begin = jnp.clip(jnp.asarray(start), 0, n - size)
            shares = self.protocol.local(
                lambda s, a=axis, b=begin, z=size: lax.dynamic_slice_in_dim(s, b, z, a), shares
            )
    return self.out(eqn, shares)


@rule("dynamic_update_slice")
def _dynamic_update_slice(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """Writes `update` at secret starts (clamped into [0, n - m] as lax does): per axis a
    placement matrix P[i, r] = [i - r = start] (the start's one-hot, shifted; public for a
    public start) carries the update and a mask of ones into place by ring matrix products
    (one round per secret axis); the result is x + placed - x * mask (one product)."""
    operand, update, *starts = values
    if not any(isinstance(s, Secret) for s in starts):
        return self.linear(eqn, values, (0, 1))
    aval = out_aval(eqn)
    shape = tuple(aval.shape)
    update_shape = tuple(np.shape(update)) if not isinstance(update, Secret) else update.shape
    placed = self.arith(update, aval.dtype)
    mask = self.protocol.lift(self.ctx, jnp.ones(update_shape, ring.RING))
    for axis, start in enumerate(starts):
        n, m = shape[axis], update_shape[axis]
        placement = _placement(self, start, n, m)
        placed = _place_along(self, placement, placed, axis)
        mask = _place_along(self, placement, mask, axis)
    x = self.arith(operand, aval.dtype)
    return self.out(eqn, x + placed - self.protocol.mul(self.ctx, x, mask))


@rule("scatter", "scatter-add")
def _scatter(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """Public indices: linear in the operand and the updates (each share scattered). Secret
    indices, each writing a whole row along one axis: each index's one-hot over the n rows
    (its low bits, 2^b products), zeroed when the index lies outside [0, n) as JAX drops it
    (two comparisons; `mode="clip"` clamps it first); the rows placed = one-hots^T @ updates
    (one round); `scatter-add` adds them, `scatter` keeps x where no index points:
    x + placed - x * hit (one product). Duplicate indices add in `scatter-add`; in `scatter`
    they add too, where JAX keeps one of the updates."""
    operand, indices, updates = values
    aval = out_aval(eqn)
    shape = tuple(aval.shape)
    dims, mode = eqn.params["dimension_numbers"], eqn.params["mode"]
    update_shape = updates.shape if isinstance(updates, Secret) else tuple(np.shape(updates))
    if not isinstance(indices, Secret):
        scatter = lax.scatter_add if eqn.primitive.name == "scatter-add" else lax.scatter
        unique = bool(eqn.params["unique_indices"])

        def on_share(x: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
            return scatter(x, indices, u, dims, unique_indices=unique, mode=mode)

        x, u = self.arith(operand, aval.dtype), self.arith(updates, aval.dtype, update_shape)
        return self.out(eqn, self.protocol.local(on_share, x, u))
    batch_rank = len(indices.shape) - 1
    axes = tuple(int(a) for a in dims.scatter_dims_to_operand_dims)
    rest = tuple(shape[d] for d in range(len(shape)) if d not in axes)
    if not (
        axes
        and indices.shape[-1] == len(axes)
        and set(dims.inserted_window_dims) == set(axes)
        and not dims.operand_batching_dims
        and tuple(dims.update_window_dims) == tuple(range(batch_rank, len(update_shape)))
        and update_shape[batch_rank:] == rest
    ):
        raise TraceError(
            f"{self.where}: {eqn.primitive.name} at secret indices writes whole rows along "
            f"one axis (x.at[i].set(v), x.at[i].add(v)) or points of several "
            f"(x.at[i, j].set(v)), not {dims}; {UNSUPPORTED_HINT}"
        )
    bounds = np.asarray([shape[a] for a in axes], np.int32)
    n = int(np.prod(bounds))
    if "CLIP" in str(mode):
        (indices,) = self.eval_as(lambda v: jnp.clip(v, 0, bounds - 1), [indices])
    inside, index = self.eval_as(
        lambda v: (
            jnp.all((v >= 0) & (v < bounds), axis=-1),
            jnp.sum(v * _strides(bounds), axis=-1),
        ),
        [indices],
    )
    index = self.arith(index, np.int64)  # (2, *batch)
    onehot = one_hot(self, index_digits(self, index, n), index.shape[1:])[..., :n]
    inside_rows = self.arith(inside, np.int64)  # (2, *batch): 1 where kept
    hit = self.protocol.mul(
        self.ctx, onehot, jnp.broadcast_to(inside_rows[..., None], onehot.shape)
    )
    over_batch = tuple(range(batch_rank))
    rows = self.arith(updates, aval.dtype, update_shape)
    placed = self.protocol.dot_general(
        self.ctx, hit, rows, ((over_batch, over_batch), ((), ()))
    )  # (2, n, *rest): x's points, merged
    x = _merged(self, Secret(self.arith(operand, aval.dtype), shape, aval.dtype), axes, aval.dtype)
    if eqn.primitive.name == "scatter-add":
        written = x.shares + placed
    else:
        batch = tuple(range(1, 1 + batch_rank))
        points_hit = jnp.sum(hit, axis=batch, dtype=ring.RING) if batch else hit
        mask = jnp.broadcast_to(
            points_hit.reshape(*points_hit.shape, *(1 for _ in rest)), x.shares.shape
        )
        written = x.shares + placed - self.protocol.mul(self.ctx, x.shares, mask)
    return self.out(eqn, self.protocol.local(lambda s: _unmerged(s, shape, axes), written))


def _unmerged(share: jnp.ndarray, shape: tuple[int, ...], axes: tuple[int, ...]) -> jnp.ndarray:
    """`_merged`'s inverse on one share: the operand's layout again."""
    order = [*axes, *(d for d in range(len(shape)) if d not in axes)]
    split = share.reshape(*(shape[d] for d in order))
    return jnp.transpose(split, [order.index(d) for d in range(len(shape))])


def _placement(self: Interpreter, start: Value, n: int, m: int) -> Value:
    """P (n, m) with P[i, r] = 1 where i - r is the clamped start: shares for a secret start,
    a public ring array otherwise."""
    if not isinstance(start, Secret):
        first = jnp.clip(jnp.asarray(start), 0, n - m)
        rows, cols = np.arange(n)[:, None], np.arange(m)[None, :]
        return ((rows - cols) == first).astype(ring.RING)
    (first,) = self.eval_as(lambda v: jnp.clip(v, 0, n - m), [start])
    index = self.arith(first, np.int64)
    onehot = one_hot(self, index_digits(self, index, n - m + 1), ())[..., : n - m + 1]
    columns = [
        jnp.pad(onehot, [(0, 0), (r, m - 1 - r)]) for r in range(m)
    ]  # column r: the one-hot moved down by r
    return jnp.stack(columns, axis=-1)


def _place_along(self: Interpreter, placement: Value, shares: Shares, axis: int) -> Shares:
    """sum_r P[i, r] * value[..., r, ...] along `axis`: the value moved into place."""
    contract = (((1,), (axis,)), ((), ()))
    if isinstance(placement, jnp.ndarray) and placement.ndim == 2:  # public
        moved = self.protocol.local(lambda s: ring.dot_general(placement, s, contract), shares)
    else:
        moved = self.protocol.dot_general(self.ctx, placement, shares, contract)
    return jnp.moveaxis(moved, 1, 1 + axis)


def read_rows(self: Interpreter, table: Value, axis: int, index: Shares, dtype: Any) -> Shares:
    """Shares of table's rows (along `axis`) at each secret index: (*index shape, *table
    without `axis`)."""
    n = int(np.shape(table)[axis]) if not isinstance(table, Secret) else table.shape[axis]
    digits = index_digits(self, index, n)
    width = len(digits)
    low_width = width // 2
    shape = index.shape[1:]
    low = one_hot(self, digits[:low_width], shape)
    high = one_hot(self, digits[low_width:], shape)
    grid_shape = (1 << (width - low_width), 1 << low_width)
    if isinstance(table, Secret):
        cells = self.protocol.local(lambda s: _grid(s, axis, n, grid_shape), table.shares)
    else:
        cells = jnp.asarray(_grid(self.encode(table, dtype), axis, n, grid_shape))
    rest = cells.shape[2:] if not isinstance(table, Secret) else cells.shape[3:]
    index_rank = index.ndim - 1
    contract = (((index_rank,), (0,)), ((), ()))
    if isinstance(table, Secret):
        picked = self.protocol.dot_general(self.ctx, high, cells, contract)
    else:
        picked = self.protocol.local(lambda h: ring.dot_general(h, cells, contract), high)
    # picked: (2, *index shape, 2^low, *rest); weight each candidate by the low one-hot
    weights = low.reshape(*low.shape, *([1] * len(rest)))
    chosen = self.protocol.mul(self.ctx, jnp.broadcast_to(weights, picked.shape), picked)
    return jnp.sum(chosen, axis=1 + index_rank, dtype=ring.RING)


def _along_axis(
    self: Interpreter, eqn: JaxprEqn, operand: Value, indices: Secret, dims: Any, sizes: Any
) -> Shares:
    """`jnp.take_along_axis` with secret indices (a gather whose other operand axes are
    batched with the indices'): each index's full one-hot over the axis (b rounds, 2^b
    products), times the operand's row it belongs to, summed (one more product round)."""
    shape = tuple(np.shape(operand)) if not isinstance(operand, Secret) else operand.shape
    batched, batched_at = tuple(dims.operand_batching_dims), tuple(dims.start_indices_batching_dims)
    if not (
        len(dims.start_index_map) == 1
        and tuple(dims.collapsed_slice_dims) == tuple(dims.start_index_map)
        and not dims.offset_dims
        and len(shape) == len(batched) + 1
        and all(size == 1 for size in sizes)
    ):
        raise TraceError(
            f"{self.where}: gather with secret indices is supported for whole rows along one "
            f"axis and for jnp.take_along_axis, not {dims}; {UNSUPPORTED_HINT}"
        )
    axis = int(dims.start_index_map[0])
    n = shape[axis]
    index = self.arith(indices, np.int64)[..., 0]  # (2, *index axes)
    rank = index.ndim - 1
    onehot = one_hot(self, index_digits(self, index, n), index.shape[1:])[..., :n]
    order = [batched[batched_at.index(t)] for t in range(rank) if t in batched_at] + [axis]
    aligned = [shape[batched[batched_at.index(t)]] if t in batched_at else 1 for t in range(rank)]

    def align(table: jnp.ndarray) -> jnp.ndarray:
        moved = jnp.transpose(table, order).reshape(*aligned, n)
        return jnp.broadcast_to(moved, onehot.shape[1:])

    if isinstance(operand, Secret):
        rows = self.protocol.local(align, operand.shares)
        picked = self.protocol.mul(self.ctx, onehot, rows)
    else:
        public = align(self.encode(operand, out_aval(eqn).dtype))
        picked = self.protocol.local(lambda s: s * public, onehot)
    return jnp.sum(picked, axis=-1, dtype=ring.RING)


def _grid(table: jnp.ndarray, axis: int, n: int, grid: tuple[int, int]) -> jnp.ndarray:
    """The table's rows along `axis`, zero-padded to high x low and laid out as that grid."""
    rows = jnp.moveaxis(table, axis, 0)
    padded = jnp.pad(rows, [(0, grid[0] * grid[1] - n)] + [(0, 0)] * (rows.ndim - 1))
    return padded.reshape(*grid, *rows.shape[1:])


def _indexed_axes(
    self: Interpreter, eqn: JaxprEqn, operand: Value, dims: Any, slice_sizes: Any
) -> tuple[int, ...]:
    """The operand axes a gather with secret indices reads points of, taking the whole of
    the other axes: one axis (table[i], jnp.take(table, i, axis)), or several, collapsed
    (table[i, j])."""
    shape = np.shape(operand) if not isinstance(operand, Secret) else operand.shape
    axes = tuple(int(a) for a in dims.start_index_map)
    collapsed = tuple(dims.collapsed_slice_dims)
    if (
        axes
        and (set(collapsed) == set(axes) or (len(axes) == 1 and not collapsed))
        and not getattr(dims, "operand_batching_dims", ())
        and all(size == (1 if d in axes else shape[d]) for d, size in enumerate(slice_sizes))
    ):
        return axes
    raise TraceError(
        f"{self.where}: gather with secret indices is supported for reading whole rows along "
        f"one axis (table[i], jnp.take(table, i, axis)) or points of several (table[i, j]), "
        f"not {dims}; {UNSUPPORTED_HINT}"
    )
