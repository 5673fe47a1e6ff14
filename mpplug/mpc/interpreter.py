"""Runs a user's jaxpr on secret shares: the walk over its equations, applying each
primitive's secure rule (`rules`) while the share program is traced, so every rule's local
work fuses into the round's PFunction.

Values are `Secret` (shares plus the logical type) or public JAX arrays; a primitive whose
operands are all public runs as itself. Inner jaxprs (pjit, custom_jvp/vjp, remat) are inlined.

Integers narrower than 64 bits wrap as JAX wraps them: ring arithmetic leaves a sum or product
right modulo 2^w (marked `wide`), and a primitive that reads more than its w low bits (a
comparison, a division, a conversion to a wider type or to a real) gets it wrapped first
(`wrapped`: its w low bits weighed back as the dtype's two's complement, 9 rounds for
int32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mpplug.core import progress
from mpplug.errors import TraceError
from mpplug.mpc import emit, ring
from mpplug.mpc.fixed import Fxp
from mpplug.mpc.protocol import Context, Protocol, Shares
from mpplug.mpc.rules import (  # noqa: F401  (importing a family registers its rules)
    NAMED_FUNCTIONS,
    RULES,
    approximations,
    arithmetic,
    bits,
    comparison,
    control,
    convolution,
    indexing,
    selection,
    structure,
)
from mpplug.mpc.secret import (
    UNSUPPORTED_HINT,
    Secret,
    Value,
    broadcast_shares,
    is_float,
    is_narrow_int,
    out_aval,
)

if TYPE_CHECKING:
    from mpplug.mpc.loops import Looping

__all__ = ["Interpreter", "Secret", "Value", "is_float"]

T = TypeVar("T")


_INLINED = (
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat",
    "checkpoint",
    "custom_lin",
)


_STRUCTURAL = (
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "slice",
    "rev",
    "tile",
    "copy",
    "copy_p",
    "reduce_precision",
)
"""Rearrange elements only: applied to each share, for either kind of shares."""


_LINEAR: dict[str, tuple[int, ...] | None] = {
    "add": None,
    "sub": None,
    "neg": None,
    "reduce_sum": None,
    "cumsum": None,
    "concatenate": None,
    "pad": None,
    "add_any": None,
}
"""Linear over the ring: the data operands (None: all) are lifted to shares when public."""


_OVERFLOWING = frozenset(
    {
        *("add", "sub", "neg", "add_any", "reduce_sum", "cumsum", "reduce_window_sum"),
        *("mul", "square", "integer_pow", "dot_general", "conv_general_dilated"),
        *("reduce_prod", "cumprod", "shift_left"),
    }
)
"""Ring arithmetic: right modulo 2^w from operands right modulo 2^w (so wide operands are
not wrapped first), and possibly beyond the w-bit range itself."""

_KEEPING = frozenset(
    {*_STRUCTURAL, "concatenate", "pad", "not", "select_n", "stop_gradient", "split", "stack"}
)
"""Move, select or map (-1 - x) elements: wide exactly where an operand is."""

_REWEIGHING = frozenset(
    {"and", "or", "xor", "shift_right_logical", "shift_right_arithmetic", "population_count"}
)
"""Work on the w low bits and weigh them back: within range whatever the operands."""

_BOUNDED = frozenset(
    {
        *("max", "min", "clamp", "sign", "rem", "floor", "ceil", "round"),
        *("reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin"),
        *("sort", "top_k", "gather", "dynamic_slice", "dynamic_update_slice", "scatter"),
        *("reduce_window_max", "reduce_window_min", "reduce_xor"),
    }
)
"""Within range from operands within range (which they get wrapped). Any other primitive's
narrow integer results count as wide."""


class Interpreter:
    """Evaluates jaxprs on shares for one share program."""

    def __init__(
        self, protocol: Protocol, ctx: Context, where: str, loops: Looping | None = None
    ) -> None:
        self.protocol = protocol
        self.ctx = ctx
        self.fx = Fxp(protocol, ctx)
        self.where = where
        self.loops = loops
        """Makes scans loops of the share program; None: scans are unrolled."""
        self.memo: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}
        """Results computed once per share program (see `remember`)."""

    # -- conversions ------------------------------------------------------------------------

    def encode(self, value: Any, dtype: Any) -> jnp.ndarray:
        if is_float(dtype):
            return ring.encode(value, self.ctx.frac_bits)
        return ring.to_ring(value)

    def arith(self, value: Value, dtype: Any, shape: Sequence[int] | None = None) -> Shares:
        """Arithmetic shares of a secret or public value (public values lifted)."""
        if isinstance(value, Secret):
            shares = value.shares
            if value.boolean:
                bits = shares
                shares = self.remember(("b2a", bits), lambda: self.protocol.b2a(self.ctx, bits))
                if is_float(dtype):
                    shares = shares << np.uint64(self.ctx.frac_bits)
            if shape is not None:
                shares = broadcast_shares(shares, shape)
            return shares
        public = jnp.asarray(value)
        if shape is not None:
            public = jnp.broadcast_to(public, shape)
        return self.protocol.lift(self.ctx, self.encode(public, dtype))

    def remember(self, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """`make()`, computed once per share program for `key`: what the result is computed
        from (values and traced arrays by identity, constants by value), so that a comparison
        JAX writes twice (`max(x, 0)` in a forward pass, `x > 0` in its gradient) costs once."""
        token = tuple(_token(k) for k in key)
        hit = self.memo.get(token)
        if hit is None:
            hit = (key, make())  # holding key's objects keeps their identities unique
            self.memo[token] = hit
        return cast(T, hit[1])

    def boolean(self, value: Value) -> Shares:
        """XOR shares of bit 0 of a boolean secret or public value; a bool held as
        arithmetic 0/1 shares (sealed, or summed) gives its lowest bit (`low_bits`, once)."""
        if isinstance(value, Secret):
            if value.boolean:
                return value.shares
            shares = value.shares
            return self.remember(
                ("a2b", shares), lambda: self.protocol.low_bits(self.ctx, shares, 1)
            )
        return self.protocol.lift(self.ctx, ring.to_ring(jnp.asarray(value)))

    # -- evaluation -------------------------------------------------------------------------

    def eval(
        self,
        jaxpr: Jaxpr,
        consts: Sequence[Any],
        args: Sequence[Value],
        label: str | None = None,
    ) -> list[Value]:
        """`jaxpr` on `args`, each equation by its rule; with a `label`, its progress is
        logged under it (see `progress.Steps`)."""
        env: dict[Any, Value] = {}

        def read(v: Any) -> Value:
            return v.val if isinstance(v, Literal) else env[v]

        for v, value in zip(jaxpr.constvars, consts, strict=True):
            env[v] = value
        for v, value in zip(jaxpr.invars, args, strict=True):
            env[v] = value
        live = _live(jaxpr)
        steps = progress.Steps(label, "interpreted", len(live), "equations") if label else None
        for done, eqn in enumerate(live, 1):
            values = [read(v) for v in eqn.invars]
            outs = self.apply(eqn, values)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, out in zip(eqn.outvars, outs, strict=True):
                env[v] = out
            if steps is not None:
                steps.step(done)
        if steps is not None:
            steps.end()
        return [read(v) for v in jaxpr.outvars]

    def eval_as(self, fn: Callable[..., Any], values: Sequence[Value]) -> list[Value]:
        """Interpret the plain JAX function `fn` on `values` (a rule written as JAX code
        made of primitives that have rules)."""
        avals = [
            jax.ShapeDtypeStruct(v.shape, v.dtype)
            if isinstance(v, Secret)
            else jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v))
            for v in values
        ]
        closed = jax.make_jaxpr(fn)(*avals)
        return self.eval(closed.jaxpr, closed.consts, values)

    def apply(self, eqn: JaxprEqn, values: list[Value]) -> Any:
        name = eqn.primitive.name
        if name in _INLINED:
            named = NAMED_FUNCTIONS.get(str(eqn.params.get("name")))
            if named is not None and any(isinstance(v, Secret) for v in values):
                return self.eval_as(named, values)
            inner = _inner_jaxpr(eqn)
            return self.eval(inner.jaxpr, inner.consts, values)
        if not any(isinstance(v, Secret) for v in values):
            params = eqn.primitive.get_bind_params(eqn.params)
            if any(isinstance(v, jax.core.Tracer) for v in values):
                return eqn.primitive.bind(*values, **params)
            # constants stay constants (a divisor, a shift), computed without a compile
            folded = emit.evaluated(eqn, values)
            with jax.ensure_compile_time_eval():
                if folded is not None:  # placed as JAX places what it computes
                    outs = jax.device_put(folded)
                    return outs if eqn.primitive.multiple_results else outs[0]
                return eqn.primitive.bind(*values, **params)
        if any(isinstance(v, Secret) and v.wide for v in values):
            needed = _to_wrap(eqn, values)
            values = [self.wrapped(v) if i in needed else v for i, v in enumerate(values)]
        if name in _STRUCTURAL:
            result = self.structural(eqn, values)
        elif name in _LINEAR:
            result = self.linear(eqn, values, _LINEAR[name])
        else:
            fn = RULES.get(name)
            if fn is None:
                source = _source_line(eqn)
                raise TraceError(
                    f"{self.where}: no secure rule for the JAX primitive {name!r}"
                    f"{f' (from {source})' if source else ''}; {UNSUPPORTED_HINT}"
                )
            result = fn(self, eqn, values)
        if isinstance(result, list | tuple):
            return [_marked(eqn, out, values) for out in result]
        return _marked(eqn, result, values)

    def wrapped(self, value: Value) -> Value:
        """A wide integer wrapped into its dtype's range: its w low bits (a carry-save and
        Kogge-Stone adder) weighed back as the dtype's two's complement (9 rounds for int32)."""
        if not isinstance(value, Secret) or not value.wide:
            return value
        shares, dtype = value.shares, value.dtype

        def wrap() -> Shares:
            low = self.protocol.low_bits(self.ctx, shares, bits.width_of(dtype))
            return bits.from_bits(self, low, dtype, bits.value_weights(dtype))

        return Secret(self.remember(("wrap", shares), wrap), value.shape, dtype)

    def out(
        self, eqn: JaxprEqn, shares: Shares, *, boolean: bool = False, index: int = 0
    ) -> Secret:
        aval = out_aval(eqn, index)
        return Secret(shares, tuple(aval.shape), np.dtype(aval.dtype), boolean)

    def bind_on_shares(
        self, eqn: JaxprEqn, values: list[Value], data: Sequence[int], shares: list[Shares]
    ) -> Shares:
        params = eqn.primitive.get_bind_params(eqn.params)

        def on_share(*parts: jnp.ndarray) -> jnp.ndarray:
            operands = list(values)
            for i, part in zip(data, parts, strict=True):
                operands[i] = part
            return eqn.primitive.bind(*operands, **params)

        return self.protocol.local(on_share, *shares)

    def structural(self, eqn: JaxprEqn, values: list[Value]) -> Secret:
        first = values[0]
        if any(isinstance(v, Secret) for v in values[1:]):
            raise TraceError(
                f"{self.where}: {eqn.primitive.name} with a secret index is not supported; "
                f"{UNSUPPORTED_HINT}"
            )
        result = self.bind_on_shares(eqn, values, (0,), [first.shares])
        return self.out(eqn, result, boolean=first.boolean)

    def linear(self, eqn: JaxprEqn, values: list[Value], data: tuple[int, ...] | None) -> Secret:
        positions = list(range(len(values)) if data is None else data)
        if any(isinstance(v, Secret) for i, v in enumerate(values) if i not in positions):
            raise TraceError(
                f"{self.where}: {eqn.primitive.name} with a secret index is not supported; "
                f"{UNSUPPORTED_HINT}"
            )
        aval = out_aval(eqn)
        elementwise = eqn.primitive.name in ("add", "sub", "add_any")
        shape = aval.shape if elementwise else None
        shares = [self.arith(values[i], aval.dtype, shape) for i in positions]
        return self.out(eqn, self.bind_on_shares(eqn, values, positions, shares))


def _to_wrap(eqn: JaxprEqn, values: list[Value]) -> range | tuple[int, ...]:
    """The operands `eqn` needs within their dtype's range: its predicate or index for
    `select_n` and `cond`, none for loops (their bodies wrap what they need), for ring
    arithmetic, moves and bit work, or for a conversion to an integer no wider; all others."""
    name = eqn.primitive.name
    if name in ("select_n", "cond"):
        return (0,)
    if name in _OVERFLOWING or name in _KEEPING or name in _REWEIGHING or name in _LOOPS:
        return ()
    if name == "convert_element_type" and _narrowing(values[0], eqn.params["new_dtype"]):
        return ()
    return range(len(values))


_LOOPS = ("scan", "while")


def _narrowing(x: Value, new: Any) -> bool:
    """A conversion of integer `x` to an integer type no wider (its new w low bits)."""
    new, old = np.dtype(new), np.dtype(x.dtype)
    return new.kind in "iu" and old.kind in "iu" and new.itemsize <= old.itemsize


def _marked(eqn: JaxprEqn, out: Any, operands: list[Value]) -> Any:
    """`out` marked wide where it may lie beyond its narrow integer dtype's range."""
    if not isinstance(out, Secret) or out.boolean or not is_narrow_int(out.dtype):
        return out
    name = eqn.primitive.name
    operands_wide = any(isinstance(v, Secret) and v.wide for v in operands)
    if name == "convert_element_type":  # within range, unless converted to its own dtype
        first = operands[0]
        wide = isinstance(first, Secret) and first.wide and first.dtype == out.dtype
    elif name in _KEEPING:
        wide = operands_wide
    else:
        wide = name not in _REWEIGHING and name not in _BOUNDED
    return out if out.wide == wide else dataclasses.replace(out, wide=wide)


def _token(part: Any) -> Any:
    """A hashable stand-in for part of a `remember` key."""
    if isinstance(part, str | int | tuple) and not isinstance(part, bool):
        return part
    if isinstance(part, Secret | jax.core.Tracer):
        return ("id", id(part))
    value = np.asarray(part)
    if value.dtype == object:
        return ("id", id(part))
    if value.dtype.kind in "iu" and value.size and max(abs(int(v)) for v in value.flat) > 2**53:
        return ("constant", value.shape, tuple(int(v) for v in value.flat))  # beyond float64
    return ("constant", value.shape, value.astype(np.float64).tobytes())


def _live(jaxpr: Jaxpr) -> list[JaxprEqn]:
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            live.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return live[::-1]


def _inner_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if inner is None:
            continue
        if isinstance(inner, ClosedJaxpr):
            return inner
        if isinstance(inner, Jaxpr):
            return ClosedJaxpr(inner, ())
    raise TraceError(f"mp.mpc.run: cannot inline {eqn.primitive.name}: no inner jaxpr found")


def _source_line(eqn: JaxprEqn) -> str:
    info = getattr(eqn, "source_info", None)
    traceback = getattr(info, "traceback", None)
    if traceback is None:
        return ""
    for frame in traceback.frames:
        if "/jax/" not in frame.file_name and "/mpplug/mpc/" not in frame.file_name:
            return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.line_num}"
    return ""
