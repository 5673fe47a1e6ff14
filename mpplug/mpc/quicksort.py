"""Sorting by shuffling first: a secret shuffle, then a quicksort whose comparisons are opened;
`lax.sort` on one secret key (any payload operands), stable as JAX sorts.

Hamada, Kikuchi, Ikarashi, Chida and Takahashi, "Practically efficient multi-party sorting
protocols from comparison sort algorithms" (ICISC 2012); SPU's `quick_sort` does the same. Once
the elements sit in an order no party knows, the outcomes of comparisons among them can be
opened, as they depend on that random order alone, provided no two elements compare equal.
Each element carries a label, its position before the shuffle (secret after it), and sorts by
(key, label): no ties, so nothing about equal keys shows, and equal keys keep their order.
e before p is the sign of (k_e - k_p) - [l_e < l_p]: the labels' comparison (a narrow adder
over the labels' width, beside the key's) is the carry into the key's 64-bit adder, joined
to it by two 1-bit ANDs.

Each level compares every element with the first element of its segment (the pivot), opens
the bits, and splits every segment into (before, pivot, after) by public index arithmetic
that moves the shares locally. A level is one iteration of a share program `while` loop that
runs until every segment holds one element: about 4.3 ln n levels (a random binary search
tree's height: 45 for n = 1e5), never more than n.

Cost per element and level: the 64-bit sign (31.75 bytes a party), the labels' sign beside it
(15.75 bytes a party for labels past 2^15, 7.75 below), the carry joined (a quarter byte: two
one-bit ANDs, eight to a byte) and the opened bit: 10 rounds deep (the sign's 8, the join,
the opening). The shuffle: 2 rounds and 10.7 bytes a party per element and operand (key,
label and each payload). The parties learn the number of levels and the opened bits: a
function of the random order alone (simulated by sorting a random permutation). Threat
model: ABY3's (`mpplug.mpc.aby3`), semi-honest with one corrupted party; the shuffle's
permutation is unknown to any one party, each missing one of its three factors, and two
colluding parties learn it, as they learn every share.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from mpplug.mpc import ring
from mpplug.mpc.protocol import Context, Protocol, Shares
from mpplug.mpc.recording import WHILE, Recording
from mpplug.mpc.rounds import ITERATION, Body, loop_p, record_rounds
from mpplug.mpc.rules.comparison import full_range
from mpplug.mpc.secret import Secret, Value, traced_as

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter

SMALLEST = 512
"""Below this many elements a sort runs Batcher's network: about as many rounds and bytes
(at 256 elements, 396 rounds and 855 bytes a party per element against about 310 and 870)."""


def applies(it: Interpreter, values: list[Value], num_keys: int, dimension: int) -> bool:
    """Whether `lax.sort(values, dimension, num_keys)` runs as a shuffled quicksort here: one
    secret key that is not a 64-bit integer (those take the network's overflow-safe
    comparison), a long enough axis, and a share program that can hold a loop (not a loop's
    body)."""
    key = values[0]
    return (
        it.loops is not None
        and num_keys == 1
        and isinstance(key, Secret)
        and not full_range(key.dtype)
        and SMALLEST <= key.shape[dimension] < 2**31
    )


def sort(it: Interpreter, values: list[Value], dimension: int) -> list[Secret]:
    """`lax.sort(values, dimension, num_keys=1)`, ascending and stable, every output secret."""
    protocol, ctx = it.protocol, it.ctx
    assert it.loops is not None
    shape = tuple(values[0].shape)
    n = shape[dimension]
    size = math.prod(shape)
    columns = [
        jnp.moveaxis(it.arith(v, v.dtype, shape), dimension + 1, -1).reshape(2, size)
        for v in values
    ]
    labels = jnp.arange(size, dtype=ring.RING) % np.uint64(n)
    stacked = jnp.stack([columns[0], protocol.lift(ctx, labels), *columns[1:]], axis=1)
    shuffled = protocol.shuffle(ctx, stacked, size // n)
    starts = (jnp.arange(size, dtype=jnp.int32) // n) * n
    carry = [
        traced_as(ctx.role, jnp.int32(0)),
        traced_as(ctx.role, jnp.bool_(True)),
        traced_as(ctx.role, starts),
        traced_as(ctx.role, starts + n),
        shuffled,
    ]
    levels = _Levels(protocol, ctx, n)
    recording = levels.record(it.loops.platforms, carry)
    outs = loop_p.bind(
        ctx.role,
        ctx.keys,
        *carry,
        body=Body(recording, 2),
        length=WHILE,
        out=tuple(jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in carry),
    )
    ordered = outs[-1]
    moved = [d for d in range(len(shape)) if d != dimension] + [dimension]
    results = []
    for k, v in enumerate(values):
        column = ordered[:, 0 if k == 0 else k + 1]
        column = column.reshape(2, *(shape[d] for d in moved))
        results.append(Secret(jnp.moveaxis(column, -1, dimension + 1), shape, np.dtype(v.dtype)))
    return results


class _Levels:
    """The body of the quicksort's loop: one level, as a share program of its own."""

    def __init__(self, protocol: Protocol, ctx: Context, n: int) -> None:
        self.protocol, self.ctx, self.n = protocol, ctx, n
        self.width = 8 if n <= 2**7 else 16 if n <= 2**15 else 32
        """Bits that hold the difference of two labels, with its sign."""

    def record(self, platforms: Any, carry: list[Any]) -> Recording:
        """Trace a level and split it into rounds; reserves the PRF streams of every level
        it may run (at most n), so no stream is drawn twice."""
        base = self.ctx.next_stream()
        count = [base]

        def next_stream(many: int = 1) -> int:
            count[0] += many
            return count[0] - many

        def level(t: Any, role: Any, keys: Any, *state: Any) -> list[Any]:
            ctx = Context(role, keys, self.ctx.frac_bits, next_stream, self.ctx.truncation)
            return self.level(ctx, *state)

        avals = [
            ITERATION,
            jax.ShapeDtypeStruct(self.ctx.role.shape, self.ctx.role.dtype),
            jax.ShapeDtypeStruct(self.ctx.keys.shape, self.ctx.keys.dtype),
            *(jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in carry),
        ]
        with jax.enable_x64(True):
            closed = jax.make_jaxpr(level)(*avals)
        streams = count[0] - base
        self.ctx.next_stream(max(0, self.n * streams - 1))
        return record_rounds(closed, avals, platforms, iteration=(0, streams) if streams else None)

    def level(
        self, ctx: Context, t: Any, going: Any, starts: Any, ends: Any, state: Shares
    ) -> list[Any]:
        """Compare each element with its segment's pivot, open the bits, split the segments:
        (t, whether to go on, where each position's segment starts and ends, shares) -> the
        same after this level."""
        protocol = self.protocol
        pivots = jnp.take(state[:, :2], starts, axis=-1)
        keys, labels = state[:, 0] - pivots[:, 0], state[:, 1] - pivots[:, 1]
        earlier = protocol.msb(ctx, labels, self.width)  # l_e < l_p
        one = protocol.lift(ctx, jnp.ones(keys.shape[1:], ring.RING))
        # sign of (k_e - k_p) - [l_e < l_p] = sign of (k_e - k_p - 1) + (1 - [l_e < l_p])
        before = protocol.msb(ctx, keys - one, carry=protocol.xor_public(ctx, earlier, 1))
        bits = protocol.open_bits(ctx, before)
        order, new_starts, new_ends = _split(starts, ends, bits)
        more = jnp.any(new_ends - new_starts > 1) & (t + 1 < self.n)
        return [t + 1, more, new_starts, new_ends, jnp.take(state, order, axis=-1)]


def _split(
    starts: jnp.ndarray, ends: jnp.ndarray, bits: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Each segment [s, e) reordered as (elements whose bit is set, its pivot at s, the rest),
    each part in its order: (the old position of each new one, where each new position's
    segment starts and ends). A pivot's bit is never set (it is not before itself)."""
    size = starts.shape[0]
    index = jnp.arange(size, dtype=jnp.int32)
    b = bits.astype(jnp.int32)
    prefix = _scan(jnp.concatenate([jnp.zeros((1,), jnp.int32), b]), jnp.add, 0)
    at_start = prefix[starts]
    middle = starts + prefix[ends] - at_start  # where the pivot goes
    earlier = prefix[:-1] - at_start  # set bits before this position in its segment
    pivot = index == starts
    later = middle + 1 + (index - starts - 1 - earlier)  # after the pivot, in order
    destination = jnp.where(pivot, middle, jnp.where(b == 1, starts + earlier, later))
    start = jnp.where(pivot, middle, jnp.where(b == 1, starts, middle + 1))
    end = jnp.where(pivot, middle + 1, jnp.where(b == 1, middle, ends))
    order = jnp.zeros(size, jnp.int32).at[destination].set(index)
    return order, start[order], end[order]


def _scan(x: jnp.ndarray, combine: Any, fill: int, reverse: bool = False) -> jnp.ndarray:
    """Inclusive prefix `combine` of a vector (suffix with `reverse`), by Hillis and Steele's
    log2(n) shifted steps: slices and elementwise ops, which a first, interpreted run runs
    (`lax.cumsum` and its kin are windowed reductions it would have to compile)."""
    size, step = x.shape[0], 1
    while step < size:
        pad = jnp.full((step,), fill, x.dtype)
        shifted = jnp.concatenate([x[step:], pad]) if reverse else jnp.concatenate([pad, x[:-step]])
        x = combine(x, shifted)
        step *= 2
    return x
