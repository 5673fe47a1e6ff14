"""Loops of the share program: a `lax.scan` (or `lax.fori_loop` with a static trip count,
which JAX writes as a scan) inside `mp.mpc.run` traced and compiled once, run as a loop.

The scan's body is interpreted on shares into its own share program, split into rounds and
recorded (`rounds.record_rounds`), and stands in the outer share program as one `loop`
equation; the outer recording replays it as an `mp.fori_loop` whose body is the recording.
Iteration t draws its PRF streams with `t * stride` added to their numbers, so no stream is
drawn twice under one key. A scan inside a loop's body is unrolled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc.interpreter import Interpreter, Secret, Value
from mpplug.mpc.protocol import Context
from mpplug.mpc.rounds import ITERATION, Body, loop_p, record_rounds
from mpplug.mpc.secret import is_narrow_int, traced_as

Kind = bool | None
"""How a carried value travels: None public, False arithmetic shares, True boolean shares."""


def _kind(value: Value) -> Kind:
    return value.boolean if isinstance(value, Secret) else None


def _join(a: Kind, b: Kind) -> Kind:
    """The least kind both fit in: public < boolean < arithmetic."""
    if a is None:
        return b
    if b is None:
        return a
    return a and b


@dataclass
class Looping:
    """Makes loops for one share program: `platforms` as its rounds'."""

    platforms: Sequence[str] | None

    def scan(
        self,
        it: Interpreter,
        eqn: JaxprEqn,
        body: ClosedJaxpr,
        counts: tuple[int, int],
        values: list[Value],
    ) -> list[Value]:
        """The scan `eqn` (body `body`, `counts` = (constants, carries)) on `values`, as a
        loop of the share program `it` interprets into."""
        return _Scan(self, it, eqn, body, counts, values).run()


class _Scan:
    """One scan made a loop: consts and scanned inputs are invariants, the carry and one
    buffer per stacked output are carried."""

    def __init__(
        self,
        looping: Looping,
        it: Interpreter,
        eqn: JaxprEqn,
        body: ClosedJaxpr,
        counts: tuple[int, int],
        values: list[Value],
    ) -> None:
        self.looping, self.it, self.body = looping, it, body
        self.n_consts, self.n_carry = counts
        self.length = int(eqn.params["length"])
        self.reverse = bool(eqn.params["reverse"])
        self.consts = values[: self.n_consts]
        self.init = values[self.n_consts : self.n_consts + self.n_carry]
        self.xs = values[self.n_consts + self.n_carry :]
        self.ys_avals = [v.aval for v in eqn.outvars[self.n_carry :]]
        carry_avals = [v.aval for v in eqn.outvars[: self.n_carry]]
        self.slots = [*carry_avals, *self.ys_avals]
        self.kinds: list[Kind] = [_kind(v) for v in self.init] + [None] * len(self.ys_avals)
        self.wides = [_wide(v) for v in self.init]
        """Whether a carried narrow integer may be wide: where it enters so, or where the body
        gives it back so (settled as the kinds are)."""
        # invariants travel as operands only when they are values of the share program;
        # constants are captured by the body
        self.invariants = [*self.consts, *self.xs]
        self.operands = [i for i, v in enumerate(self.invariants) if _traced(v)]

    def run(self) -> list[Value]:
        it = self.it
        base = it.ctx.next_stream()
        for _ in range(3 * len(self.slots) + 1):  # each retrace moves a slot's kind or wide up
            closed, wanted, wides, streams = self._trace(base)
            if wanted == self.kinds and wides == self.wides:
                break
            self.kinds, self.wides = wanted, wides
        else:
            raise TraceError(f"{it.where}: a loop's carried values do not settle on one kind")
        it.ctx.next_stream(max(0, self.length * streams - 1))  # what every iteration draws
        avals = [
            ITERATION,
            *(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars[1:]),
        ]
        recording = record_rounds(
            closed,
            avals,
            self.looping.platforms,
            iteration=(0, streams) if streams else None,
        )
        invariants = [
            it.ctx.role,
            it.ctx.keys,
            *(self._flat(self.invariants[i]) for i in self.operands),
        ]
        carry = [self._carried(k, slot) for k, slot in enumerate(self.slots)]
        outs = loop_p.bind(
            *invariants,
            *carry,
            body=Body(recording, len(invariants)),
            length=self.length,
            out=tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in carry),
        )
        return [
            self._unflat(out, k, slot)
            for k, (out, slot) in enumerate(zip(outs, self.slots, strict=True))
        ]

    # -- the body's share program ---------------------------------------------------------------

    def _trace(self, base: int) -> tuple[ClosedJaxpr, list[Kind], list[bool], int]:
        """The body as a share program for the current kinds: (it, the kinds its outputs
        want, which carries it gives back wide, the PRF streams one iteration draws)."""
        it = self.it
        count = [base]
        wanted = list(self.kinds)
        wides = list(self.wides)

        def next_stream(many: int = 1) -> int:
            count[0] += many
            return count[0] - many

        def program(t: Any, role: Any, keys: Any, *flat: Any) -> list[Any]:
            ctx = Context(role, keys, it.ctx.frac_bits, next_stream, it.ctx.truncation)
            inner = Interpreter(it.protocol, ctx, it.where)
            operands = iter(flat[: len(self.operands)])
            invariants = [
                self._rebuild(next(operands), v) if i in self.operands else v
                for i, v in enumerate(self.invariants)
            ]
            consts, xs = invariants[: self.n_consts], invariants[self.n_consts :]
            carried = [
                self._unflat(x, k, slot)
                for k, (x, slot) in enumerate(
                    zip(flat[len(self.operands) :], self.slots, strict=True)
                )
            ]
            index = self.length - 1 - t if self.reverse else t
            rows = [_row(inner, x, index) for x in xs]
            outs = inner.eval(
                self.body.jaxpr, self.body.consts, [*consts, *carried[: self.n_carry], *rows]
            )
            new = list(outs[: self.n_carry])
            for k, (buffer, y) in enumerate(
                zip(carried[self.n_carry :], outs[self.n_carry :], strict=True)
            ):
                new.append(_written(inner, buffer, y, index, self.ys_avals[k]))
            for k, value in enumerate(new):
                wanted[k] = _join(wanted[k], _kind(value))
            for k, value in enumerate(new[: self.n_carry]):
                wides[k] = wides[k] or _wide(value)
            return [
                traced_as(role, self._to_kind(inner, value, wanted[k], slot))
                for k, (value, slot) in enumerate(zip(new, self.slots, strict=True))
            ]

        ops = [self._flat_aval(self.invariants[i]) for i in self.operands]
        slots = [self._slot_aval(k, slot) for k, slot in enumerate(self.slots)]
        role, keys = it.ctx.role, it.ctx.keys
        with jax.enable_x64(True):
            closed = jax.make_jaxpr(program)(
                ITERATION,
                jax.ShapeDtypeStruct(role.shape, role.dtype),
                jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                *ops,
                *slots,
            )
        return closed, wanted, wides, count[0] - base

    def _to_kind(self, it: Interpreter, value: Value, kind: Kind, aval: Any) -> Any:
        """The carried form of `value` in `kind` (which `value`'s own kind fits in)."""
        if kind is None:
            return jnp.broadcast_to(jnp.asarray(value, aval.dtype), aval.shape)
        if kind:
            if isinstance(value, Secret):
                return it.boolean(value)
            return it.boolean(jnp.broadcast_to(jnp.asarray(value), aval.shape))
        return it.arith(value, aval.dtype, aval.shape)

    # -- operands and results ----------------------------------------------------------------

    def _flat(self, value: Value) -> Any:
        return value.shares if isinstance(value, Secret) else value

    def _flat_aval(self, value: Value) -> jax.ShapeDtypeStruct:
        flat = self._flat(value)
        return jax.ShapeDtypeStruct(jnp.shape(flat), jnp.result_type(flat))

    def _rebuild(self, flat: Any, like: Value) -> Value:
        if isinstance(like, Secret):
            return Secret(flat, like.shape, like.dtype, like.boolean, like.wide)
        return flat

    def _slot_aval(self, k: int, slot: Any) -> jax.ShapeDtypeStruct:
        if self.kinds[k] is None:
            return jax.ShapeDtypeStruct(slot.shape, slot.dtype)
        return self.it.protocol.shares_aval(slot.shape)

    def _unflat(self, flat: Any, k: int, slot: Any) -> Value:
        kind = self.kinds[k]
        if kind is None:
            return flat
        # a stacked output's rows may be wide; a carry is as its fixpoint says
        wide = not kind and is_narrow_int(slot.dtype) and (k >= self.n_carry or self.wides[k])
        return Secret(flat, tuple(slot.shape), np.dtype(slot.dtype), kind, wide)

    def _carried(self, k: int, slot: Any) -> Any:
        """Slot k's value entering the loop, in its kind."""
        it = self.it
        if k < self.n_carry:
            value = self.init[k]
        else:
            value = jnp.zeros(slot.shape, slot.dtype)
            if self.kinds[k] is not None:  # zero words share zero in either kind
                return traced_as(it.ctx.role, jnp.zeros(self._slot_aval(k, slot).shape, np.uint64))
        return traced_as(it.ctx.role, self._to_kind(it, value, self.kinds[k], slot))


def _wide(value: Value) -> bool:
    return isinstance(value, Secret) and value.wide


def _traced(value: Value) -> bool:
    flat = value.shares if isinstance(value, Secret) else value
    return isinstance(flat, jax.core.Tracer)


def _row(it: Interpreter, x: Value, index: Any) -> Value:
    """Row `index` (a public traced int) of a scanned-over value."""

    def take(v: Any) -> Any:
        return lax.dynamic_index_in_dim(v, index, 0, keepdims=False)

    if not isinstance(x, Secret):
        return take(jnp.asarray(x))
    return Secret(it.protocol.local(take, x.shares), x.shape[1:], x.dtype, x.boolean, x.wide)


def _written(it: Interpreter, buffer: Value, y: Value, index: Any, aval: Any) -> Value:
    """`buffer` (a scan's stacked output so far) with row `index` set to `y`."""
    if not isinstance(buffer, Secret) and not isinstance(y, Secret):
        row = jnp.asarray(y, aval.dtype)[None]
        return lax.dynamic_update_index_in_dim(jnp.asarray(buffer), row, index, 0)
    public_or_boolean = not isinstance(buffer, Secret) or buffer.boolean
    boolean = isinstance(y, Secret) and y.boolean and public_or_boolean
    if boolean:
        parts = (it.boolean(buffer), it.boolean(y))
    else:
        parts = (it.arith(buffer, aval.dtype), it.arith(y, aval.dtype, aval.shape[1:]))
    shares = it.protocol.local(
        lambda b, r: lax.dynamic_update_index_in_dim(b, r[None], index, 0), *parts
    )
    wide = not boolean and is_narrow_int(aval.dtype)
    return Secret(shares, tuple(aval.shape), np.dtype(aval.dtype), boolean, wide)
