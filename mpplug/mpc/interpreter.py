"""Runs a user's jaxpr on secret shares: one rule per JAX primitive, applied while the share
program is traced (so every rule's local work fuses into the round's PFunction).

Values are `Secret` (shares plus the logical type) or public JAX arrays; a primitive whose
operands are all public runs as itself. Inner jaxprs (pjit, custom_jvp/vjp, remat) are inlined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mpplug.errors import TraceError
from mpplug.mpc import approx, ring
from mpplug.mpc.fixed import Fxp
from mpplug.mpc.protocol import Context, Protocol, Shares

if TYPE_CHECKING:
    from mpplug.mpc.loops import Looping


@dataclass(frozen=True)
class Secret:
    """Shares of a tensor of logical `shape` and `dtype`; `boolean`: XOR shares of bit 0."""

    shares: Shares
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    boolean: bool = False


Value = Any  # Secret or a public array
Rule = Callable[["Interpreter", JaxprEqn, list[Value]], Value]
RULES: dict[str, Rule] = {}

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
    "copy",
    "copy_p",
    "dynamic_slice",
    "gather",
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
    "dynamic_update_slice": (0, 1),
    "add_any": None,
}
"""Linear over the ring: the data operands (None: all) are lifted to shares when public."""
_UNSUPPORTED_HINT = (
    "write the computation with supported primitives (see docs/mpc.md), or reveal the value"
)


def is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def rule(*names: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn

    return register


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
                shares = self.protocol.b2a(self.ctx, shares)
                if is_float(dtype):
                    shares = shares << np.uint64(self.ctx.frac_bits)
            if shape is not None:
                shares = _broadcast_shares(shares, shape)
            return shares
        public = jnp.asarray(value)
        if shape is not None:
            public = jnp.broadcast_to(public, shape)
        return self.protocol.lift(self.ctx, self.encode(public, dtype))

    def boolean(self, value: Value) -> Shares:
        """XOR shares of bit 0 of a boolean secret or public value."""
        if isinstance(value, Secret):
            if value.boolean:
                return value.shares
            raise TraceError(
                f"{self.where}: bitwise logic on an arithmetic secret bool is not supported; "
                f"{_UNSUPPORTED_HINT}"
            )
        return self.protocol.lift(self.ctx, ring.to_ring(jnp.asarray(value)))

    # -- evaluation -------------------------------------------------------------------------

    def eval(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Value]) -> list[Value]:
        env: dict[Any, Value] = {}

        def read(v: Any) -> Value:
            return v.val if isinstance(v, Literal) else env[v]

        for v, value in zip(jaxpr.constvars, consts, strict=True):
            env[v] = value
        for v, value in zip(jaxpr.invars, args, strict=True):
            env[v] = value
        for eqn in _live(jaxpr):
            values = [read(v) for v in eqn.invars]
            outs = self.apply(eqn, values)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, out in zip(eqn.outvars, outs, strict=True):
                env[v] = out
        return [read(v) for v in jaxpr.outvars]

    def apply(self, eqn: JaxprEqn, values: list[Value]) -> Any:
        name = eqn.primitive.name
        if name in _INLINED:
            inner = _inner_jaxpr(eqn)
            return self.eval(inner.jaxpr, inner.consts, values)
        if not any(isinstance(v, Secret) for v in values):
            params = eqn.primitive.get_bind_params(eqn.params)
            return eqn.primitive.bind(*values, **params)
        if name in _STRUCTURAL:
            return self._structural(eqn, values)
        if name in _LINEAR:
            return self._linear(eqn, values, _LINEAR[name])
        fn = RULES.get(name)
        if fn is None:
            source = _source_line(eqn)
            raise TraceError(
                f"{self.where}: no secure rule for the JAX primitive {name!r}"
                f"{f' (from {source})' if source else ''}; {_UNSUPPORTED_HINT}"
            )
        return fn(self, eqn, values)

    def out(
        self, eqn: JaxprEqn, shares: Shares, *, boolean: bool = False, index: int = 0
    ) -> Secret:
        aval = _aval(eqn, index)
        return Secret(shares, tuple(aval.shape), np.dtype(aval.dtype), boolean)

    def _bind_on_shares(
        self, eqn: JaxprEqn, values: list[Value], data: Sequence[int], shares: list[Shares]
    ) -> Shares:
        params = eqn.primitive.get_bind_params(eqn.params)

        def on_share(*parts: jnp.ndarray) -> jnp.ndarray:
            operands = list(values)
            for i, part in zip(data, parts, strict=True):
                operands[i] = part
            return eqn.primitive.bind(*operands, **params)

        return self.protocol.local(on_share, *shares)

    def _structural(self, eqn: JaxprEqn, values: list[Value]) -> Secret:
        first = values[0]
        if any(isinstance(v, Secret) for v in values[1:]):
            raise TraceError(
                f"{self.where}: {eqn.primitive.name} with a secret index is not supported; "
                f"{_UNSUPPORTED_HINT}"
            )
        result = self._bind_on_shares(eqn, values, (0,), [first.shares])
        return self.out(eqn, result, boolean=first.boolean)

    def _linear(self, eqn: JaxprEqn, values: list[Value], data: tuple[int, ...] | None) -> Secret:
        positions = list(range(len(values)) if data is None else data)
        aval = _aval(eqn)
        elementwise = eqn.primitive.name in ("add", "sub", "add_any")
        shape = aval.shape if elementwise else None
        shares = [self.arith(values[i], aval.dtype, shape) for i in positions]
        return self.out(eqn, self._bind_on_shares(eqn, values, positions, shares))


def _broadcast_shares(shares: Shares, shape: Sequence[int]) -> Shares:
    """Shares (share axis first) broadcast to `shape` as numpy aligns trailing axes."""
    value_shape = shares.shape[1:]
    padded = (1,) * (len(shape) - len(value_shape)) + tuple(value_shape)
    return jnp.broadcast_to(shares.reshape(shares.shape[0], *padded), (shares.shape[0], *shape))


def _aval(eqn: JaxprEqn, index: int = 0) -> Any:
    """The abstract value (shape, dtype) of an equation's output."""
    return eqn.outvars[index].aval


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


# -- arithmetic --------------------------------------------------------------------------------


@rule("mul")
def _mul(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    dtype = _aval(eqn).dtype
    shape = _aval(eqn).shape
    if isinstance(x, Secret) and isinstance(y, Secret):
        bits = self.ctx.frac_bits if is_float(dtype) else 0
        a, b = self.arith(x, dtype, shape), self.arith(y, dtype, shape)
        return self.out(eqn, self.protocol.mul(self.ctx, a, b, bits))
    secret, public = (x, y) if isinstance(x, Secret) else (y, x)
    shares = self.arith(secret, dtype, shape)
    if is_float(dtype):
        return self.out(eqn, _times_public(self, shares, public, shape))
    return self.out(eqn, shares * jnp.broadcast_to(self.encode(public, dtype), shape))


MAX_EXTRA_BITS = 20


def _times_public(self: Interpreter, shares: Shares, public: Any, shape: Sequence[int]) -> Shares:
    """Fixed-point shares times a public real, one truncation. A known constant below 1 is
    encoded with extra fraction bits (as many as it has leading zeros, up to 20), so that
    x * 1e-4 or x / 1000 keep 18 significant bits instead of a handful; a known integer
    constant (x * 2, x * 1.0) is a local, exact product."""
    extra = 0
    if not isinstance(public, jax.core.Tracer):
        known = np.asarray(public, np.float64)
        if np.all(np.isfinite(known)) and np.all(known == np.round(known)):
            integers = jnp.broadcast_to(ring.to_ring(known.astype(np.int64)), shape)
            return shares * integers
        largest = float(np.max(np.abs(known), initial=0.0))
        if 0.0 < largest < 1.0:
            extra = min(MAX_EXTRA_BITS, int(np.floor(-np.log2(largest))))
    bits = self.ctx.frac_bits + extra
    scale = jnp.broadcast_to(ring.encode(public, bits), shape)
    return self.protocol.trunc(self.ctx, shares * scale, bits)


@rule("dot_general")
def _dot_general(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    dims = eqn.params["dimension_numbers"]
    dtype = _aval(eqn).dtype
    if isinstance(x, Secret) and isinstance(y, Secret):
        bits = self.ctx.frac_bits if is_float(dtype) else 0
        a, b = self.arith(x, dtype), self.arith(y, dtype)
        return self.out(eqn, self.protocol.dot_general(self.ctx, a, b, dims, bits))
    if isinstance(x, Secret):
        public = self.encode(y, dtype)
        product = self.protocol.local(
            lambda a: ring.dot_general(a, public, dims), self.arith(x, dtype)
        )
    else:
        public = self.encode(x, dtype)
        product = self.protocol.local(
            lambda b: ring.dot_general(public, b, dims), self.arith(y, dtype)
        )
    if is_float(dtype):
        product = self.protocol.trunc(self.ctx, product, self.ctx.frac_bits)
    return self.out(eqn, product)


# -- comparisons and selection ---------------------------------------------------------------


def _difference(self: Interpreter, x: Value, y: Value, shape: Sequence[int]) -> Shares:
    dtype = x.dtype if isinstance(x, Secret) else y.dtype
    return self.arith(x, dtype, shape) - self.arith(y, dtype, shape)


def _not(self: Interpreter, bits: Shares) -> Shares:
    return self.protocol.xor_public(self.ctx, bits, jnp.uint64(1))


def _full_range(dtype: Any) -> bool:
    """64-bit integers: their differences can overflow the ring's signed range."""
    return bool(jnp.issubdtype(dtype, jnp.integer)) and np.dtype(dtype).itemsize == 8


def _below(self: Interpreter, a: Shares, b: Shares, dtype: Any) -> Shares:
    """XOR shares (bit 0) of a < b for arithmetic shares of `dtype` values.

    Reals and integers up to 32 bits: the sign of a - b, which cannot overflow (8 rounds).
    64-bit integers: signs of a, b and a - b in one batch, then a - b's sign corrected where
    a and b differ in sign, lt = s_d ^ ((s_a ^ s_b) & (s_a ^ s_d)): exact over the whole
    range for one AND round more (9 rounds, three times the sign's bytes). Unsigned 64-bit
    values are compared as signed ones after adding 2^63 to both.
    """
    if not _full_range(dtype):
        return self.protocol.msb(self.ctx, a - b)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        top = self.protocol.lift(self.ctx, jnp.full(a.shape[1:], 1 << 63, ring.RING))
        a, b = a + top, b + top
    signs = self.protocol.msb(self.ctx, jnp.stack([a, b, a - b], axis=1))
    s_a, s_b, s_d = signs[:, 0], signs[:, 1], signs[:, 2]
    return s_d ^ self.protocol.and_(self.ctx, s_a ^ s_b, s_a ^ s_d, bits=1)


def _below_arith(self: Interpreter, a: Shares, b: Shares, dtype: Any) -> Shares:
    """Arithmetic 0/1 shares of a < b."""
    return self.protocol.b2a(self.ctx, _below(self, a, b, dtype))


@rule("lt", "gt", "le", "ge")
def _order(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    shape = _aval(eqn).shape
    if eqn.primitive.name in ("gt", "le"):
        x, y = y, x
    dtype = x.dtype if isinstance(x, Secret) else y.dtype
    below = _below(self, self.arith(x, dtype, shape), self.arith(y, dtype, shape), dtype)
    if eqn.primitive.name in ("le", "ge"):
        below = _not(self, below)
    return self.out(eqn, below, boolean=True)


@rule("eq", "ne")
def _equality(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    if not isinstance(y, Secret) or not isinstance(x, Secret) or x is not y:
        shape = _aval(eqn).shape
        d = _difference(self, x, y, shape)
        both = self.protocol.msb(self.ctx, jnp.stack([d, -d], axis=1))
        differ = both[:, 0] ^ both[:, 1]  # x < y or y < x, never both
        if _full_range(x.dtype if isinstance(x, Secret) else y.dtype):
            # d = -2^63 is its own negation: both signs set. OR instead of XOR (one round).
            differ = differ ^ self.protocol.and_(self.ctx, both[:, 0], both[:, 1], bits=1)
    else:  # x != x is the NaN test; fixed-point values are never NaN
        differ = self.protocol.lift(self.ctx, jnp.zeros(x.shape, ring.RING))
    return self.out(eqn, _not(self, differ) if eqn.primitive.name == "eq" else differ, boolean=True)


@rule("select_n")
def _select_n(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    pred, *cases = values
    aval = _aval(eqn)
    shares = [self.arith(c, aval.dtype, aval.shape) for c in cases]
    if not isinstance(pred, Secret):
        params = eqn.primitive.get_bind_params(eqn.params)
        return self.out(
            eqn,
            self.protocol.local(lambda *parts: eqn.primitive.bind(pred, *parts, **params), *shares),
        )
    if len(cases) != 2:
        raise TraceError(
            f"{self.where}: select_n with a secret index over {len(cases)} cases is not "
            f"supported (only a secret bool over two); {_UNSUPPORTED_HINT}"
        )
    bit = self.arith(pred, np.int64, aval.shape)
    return self.out(eqn, shares[0] + self.protocol.mul(self.ctx, bit, shares[1] - shares[0]))


def _negative(self: Interpreter, shares: Shares) -> Shares:
    return self.fx.is_negative(shares)


@rule("max", "min")
def _extremum(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    aval = _aval(eqn)
    x, y = (self.arith(v, aval.dtype, aval.shape) for v in values)
    bit = _below_arith(self, x, y, aval.dtype)
    if eqn.primitive.name == "min":
        x, y = y, x
    return self.out(eqn, x + self.protocol.mul(self.ctx, bit, y - x))


@rule("abs")
def _abs(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x = self.arith(values[0], values[0].dtype)
    bit = _negative(self, x)
    return self.out(eqn, x - (self.protocol.mul(self.ctx, bit, x) << np.uint64(1)))


@rule("sign")
def _sign(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x = self.arith(values[0], values[0].dtype)
    signs = self.protocol.msb(self.ctx, jnp.stack([-x, x], axis=1))  # (x > 0, x < 0)
    if jnp.issubdtype(values[0].dtype, jnp.unsignedinteger):  # 0 or 1: x != 0, an OR
        both = self.protocol.and_(self.ctx, signs[:, 0], signs[:, 1], bits=1)
        return self.out(eqn, self.protocol.b2a(self.ctx, signs[:, 0] ^ signs[:, 1] ^ both))
    if _full_range(values[0].dtype):  # -2^63 is its own negation: not positive
        both = self.protocol.and_(self.ctx, signs[:, 0], signs[:, 1], bits=1)
        signs = jnp.stack([signs[:, 0] ^ both, signs[:, 1]], axis=1)
    bits = self.protocol.b2a(self.ctx, signs)
    sign = bits[:, 0] - bits[:, 1]
    if is_float(values[0].dtype):
        sign = sign << np.uint64(self.ctx.frac_bits)
    return self.out(eqn, sign)


def _reduce_extremum(
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
        bit = _below_arith(self, a, b, dtype) if largest else _below_arith(self, b, a, dtype)
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
        x, _ = _reduce_extremum(self, x, axis, largest, False, values[0].dtype)
    return self.out(eqn, x)


@rule("argmax", "argmin")
def _argmax(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (axis,) = eqn.params["axes"]
    x = self.arith(values[0], values[0].dtype)
    largest = eqn.primitive.name == "argmax"
    _, index = _reduce_extremum(self, x, axis, largest, True, values[0].dtype)
    assert index is not None
    return self.out(eqn, index)


# -- logic on bools ----------------------------------------------------------------------------


def _require_bool(self: Interpreter, eqn: JaxprEqn) -> None:
    if _aval(eqn).dtype != jnp.bool_:
        raise TraceError(
            f"{self.where}: bitwise {eqn.primitive.name} on secret integers is not supported "
            f"(only on bools); {_UNSUPPORTED_HINT}"
        )


@rule("and", "or", "xor")
def _logic(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    _require_bool(self, eqn)
    shape = _aval(eqn).shape
    a, b = (_broadcast_shares(s, shape) for s in map(self.boolean, values))
    if eqn.primitive.name == "xor":
        return self.out(eqn, a ^ b, boolean=True)
    both = self.protocol.and_(self.ctx, a, b, bits=1)
    return self.out(eqn, both if eqn.primitive.name == "and" else a ^ b ^ both, boolean=True)


@rule("reduce_and", "reduce_or")
def _reduce_logic(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """`jnp.all` / `jnp.any` over `axes`: an AND tree over XOR-shared bits, ceil(log2 n)
    rounds (OR as NOT AND NOT)."""
    _require_bool(self, eqn)
    (x,) = values
    axes = tuple(eqn.params["axes"])
    kept = [d for d in range(len(x.shape)) if d not in axes]
    count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    is_or = eqn.primitive.name == "reduce_or"
    if count == 0:  # the empty AND is true, the empty OR false
        return jnp.full(_aval(eqn).shape, not is_or)

    def flatten(s: jnp.ndarray) -> jnp.ndarray:
        moved = jnp.transpose(s, [*kept, *axes])
        return moved.reshape(*(x.shape[d] for d in kept), count)

    bits = self.protocol.local(flatten, self.boolean(x))
    if is_or:
        bits = _not(self, bits)
    while count > 1:
        half = count // 2
        low = self.protocol.local(lambda s, h=half: s[..., :h], bits)
        high = self.protocol.local(lambda s, h=half: s[..., h : 2 * h], bits)
        rest = self.protocol.local(lambda s, h=half: s[..., 2 * h :], bits)
        both = self.protocol.and_(self.ctx, low, high, bits=1)
        bits = self.protocol.local(lambda a, b: jnp.concatenate([a, b], axis=-1), both, rest)
        count = half + count % 2
    out = self.protocol.local(lambda s: s[..., 0], bits)
    return self.out(eqn, _not(self, out) if is_or else out, boolean=True)


@rule("stop_gradient")
def _stop_gradient(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """No gradient flows through it: on shares it is the value itself."""
    return values[0]


@rule("stack")
def _stack(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """`jnp.stack`: boolean shares stacked as they are when every operand is a secret bit;
    otherwise as `concatenate` (public operands lifted)."""
    if all(isinstance(v, Secret) and v.boolean for v in values):
        shares = [v.shares for v in values]
        stacked = self._bind_on_shares(eqn, values, list(range(len(values))), shares)
        return self.out(eqn, stacked, boolean=True)
    return self._linear(eqn, values, None)


@rule("not")
def _logical_not(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    _require_bool(self, eqn)
    return self.out(eqn, _not(self, self.boolean(values[0])), boolean=True)


# -- types -------------------------------------------------------------------------------------


@rule("convert_element_type")
def _convert(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    new = np.dtype(eqn.params["new_dtype"])
    if new == np.bool_:
        if x.dtype == np.bool_:
            return self.out(eqn, x.shares, boolean=x.boolean)
        raise TraceError(
            f"{self.where}: converting a secret {x.dtype} to bool is not supported; "
            f"compare it instead (x != 0)"
        )
    if x.boolean:
        return self.out(eqn, self.arith(x, new))
    if is_float(x.dtype) == is_float(new):
        return self.out(eqn, x.shares)
    if is_float(new):
        return self.out(eqn, x.shares << np.uint64(self.ctx.frac_bits))
    return self.out(eqn, _toward_zero(self, x.shares))


def _toward_zero(self: Interpreter, x: Shares) -> Shares:
    """Fixed point to integer, rounding toward zero as JAX does (24 rounds): split off the
    sign, truncate |x| (off by at most one up), correct with one comparison, sign back."""
    f = self.ctx.frac_bits
    negative = _negative(self, x)
    magnitude = x - (self.protocol.mul(self.ctx, negative, x) << np.uint64(1))
    whole = self.protocol.trunc(self.ctx, magnitude, f)
    whole = whole - _negative(self, magnitude - (whole << np.uint64(f)))
    return whole - (self.protocol.mul(self.ctx, negative, whole) << np.uint64(1))


# -- powers and division -----------------------------------------------------------------------


def _require_float(self: Interpreter, eqn: JaxprEqn, dtype: Any) -> None:
    if not is_float(dtype):
        raise TraceError(
            f"{self.where}: {eqn.primitive.name} on secret {np.dtype(dtype)} is supported only "
            f"for floating-point values (fixed point); {_UNSUPPORTED_HINT}"
        )


def _power(self: Interpreter, x: Shares, exponent: int, floating: bool) -> Shares:
    """x^exponent (exponent >= 1) by square and multiply."""

    def product(a: Shares, b: Shares) -> Shares:
        return self.protocol.mul(self.ctx, a, b, self.ctx.frac_bits if floating else 0)

    result = None
    base = x
    while exponent:
        if exponent & 1:
            result = base if result is None else product(result, base)
        exponent >>= 1
        if exponent:
            base = product(base, base)
    assert result is not None
    return result


@rule("integer_pow")
def _integer_pow(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    y = eqn.params["y"]
    floating = is_float(x.dtype)
    shares = self.arith(x, x.dtype)
    if y == 0:
        return self.out(eqn, self.arith(jnp.ones(x.shape, x.dtype), x.dtype))
    if y < 0:
        _require_float(self, eqn, x.dtype)
        return self.out(eqn, approx.reciprocal(self.fx, _power(self, shares, -y, True)))
    return self.out(eqn, _power(self, shares, y, floating))


@rule("square")
def _square(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    return self.out(eqn, _power(self, self.arith(x, x.dtype), 2, is_float(x.dtype)))


@rule("div")
def _div(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    aval = _aval(eqn)
    _require_float(self, eqn, aval.dtype)
    if not isinstance(y, Secret):
        shares = self.arith(x, aval.dtype, aval.shape)
        inverse = 1.0 / (y if isinstance(y, jax.core.Tracer) else np.asarray(y, np.float64))
        return self.out(eqn, _times_public(self, shares, inverse, aval.shape))
    reciprocal = approx.reciprocal(self.fx, self.arith(y, aval.dtype, aval.shape))
    if not isinstance(x, Secret):
        numerator = jnp.broadcast_to(ring.encode(x, self.ctx.frac_bits), aval.shape)
        product = reciprocal * numerator
        return self.out(eqn, self.protocol.trunc(self.ctx, product, self.ctx.frac_bits))
    return self.out(eqn, self.fx.mul(self.arith(x, aval.dtype, aval.shape), reciprocal))


# -- real functions ----------------------------------------------------------------------------

_APPROXIMATIONS: dict[str, Callable[[Fxp, Shares], Shares]] = {
    "exp": approx.exp,
    "log": approx.log,
    "logistic": approx.logistic,
    "tanh": approx.tanh,
    "sqrt": approx.sqrt,
    "rsqrt": approx.rsqrt,
}


@rule(*_APPROXIMATIONS)
def _approximation(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    _require_float(self, eqn, x.dtype)
    return self.out(eqn, _APPROXIMATIONS[eqn.primitive.name](self.fx, self.arith(x, x.dtype)))


@rule("log1p")
def _log1p(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    _require_float(self, eqn, x.dtype)
    return self.out(eqn, approx.log(self.fx, self.fx.add_const(self.arith(x, x.dtype), 1.0)))


@rule("pow")
def _pow(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """x ** y: a public integral y becomes integer_pow; otherwise exp(y log x) for x > 0."""
    x, y = values
    aval = _aval(eqn)
    _require_float(self, eqn, aval.dtype)
    if not isinstance(y, Secret):
        exponent = np.asarray(y)
        if exponent.ndim == 0 and float(exponent).is_integer():
            shares = self.arith(x, aval.dtype, aval.shape)
            if exponent == 0:
                return self.out(eqn, self.arith(jnp.ones(aval.shape, aval.dtype), aval.dtype))
            power = _power(self, shares, abs(int(exponent)), True)
            return self.out(eqn, power if exponent > 0 else approx.reciprocal(self.fx, power))
    logarithm = approx.log(self.fx, self.arith(x, aval.dtype, aval.shape))
    if isinstance(y, Secret):
        product = self.fx.mul(self.arith(y, aval.dtype, aval.shape), logarithm)
    else:
        scale = jnp.broadcast_to(ring.encode(y, self.ctx.frac_bits), aval.shape)
        product = self.protocol.trunc(self.ctx, logarithm * scale, self.ctx.frac_bits)
    return self.out(eqn, approx.exp(self.fx, product))


@rule("clamp")
def _clamp(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """clamp(lo, x, hi) = min(max(x, lo), hi): two comparisons in sequence."""
    lo, x, hi = values
    aval = _aval(eqn)
    shares = self.arith(x, aval.dtype, aval.shape)
    for bound, keep_larger in ((lo, True), (hi, False)):
        limit = self.arith(bound, aval.dtype, aval.shape)
        below = _below_arith(self, shares, limit, aval.dtype)
        if keep_larger:
            shares = shares + self.protocol.mul(self.ctx, below, limit - shares)
        else:
            shares = limit + self.protocol.mul(self.ctx, below, shares - limit)
    return self.out(eqn, shares)


@rule("scan")
def _scan(it: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Value]:
    """`lax.scan`, and `lax.fori_loop` with a static trip count (which JAX writes as a scan):
    a loop of the share program (see `loops`), or unrolled inside a loop's body (the body
    runs `length` times on shares, one iteration after another)."""
    params = eqn.params
    body = params["jaxpr"]
    if not isinstance(body, ClosedJaxpr):  # JAX 0.11 passes a Jaxpr and "ft_in" counts
        body = ClosedJaxpr(body, ())
    counts = _scan_counts(params)
    if counts is None:
        raise TraceError(
            f"{it.where}: lax.scan as JAX {jax.__version__} writes it (params "
            f"{sorted(params)}) is not supported yet; {_UNSUPPORTED_HINT}"
        )
    if it.loops is not None and params["length"] > 0:
        return it.loops.scan(it, eqn, body, counts, values)
    n_consts, n_carry = counts
    consts = values[:n_consts]
    carry = list(values[n_consts : n_consts + n_carry])
    xs = values[n_consts + n_carry :]
    steps = range(params["length"])
    per_step: list[list[Value]] = []
    for t in reversed(steps) if params["reverse"] else steps:
        outs = it.eval(body.jaxpr, body.consts, [*consts, *carry, *(_row(it, x, t) for x in xs)])
        carry = outs[:n_carry]
        per_step.append(outs[n_carry:])
    if params["reverse"]:
        per_step.reverse()
    ys = [
        _stacked(it, [step[k] for step in per_step], _aval(eqn, n_carry + k))
        for k in range(len(eqn.outvars) - n_carry)
    ]
    return [*carry, *ys]


def _scan_counts(params: dict[str, Any]) -> tuple[int, int] | None:
    """(constants, carries) of a scan: JAX 0.10 names them, JAX 0.11 gives "ft_in", a tuple of
    (constants, carries, scanned) entries (None where that JAX left one out: unknown here)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    groups = params.get("ft_in")
    if isinstance(groups, tuple) and len(groups) == 3 and all(isinstance(g, tuple) for g in groups):
        return len(groups[0]), len(groups[1])
    return None


def _row(it: Interpreter, x: Value, t: int) -> Value:
    """Row `t` of a scanned-over value."""
    if not isinstance(x, Secret):
        return x[t]
    return Secret(it.protocol.local(lambda s: s[t], x.shares), x.shape[1:], x.dtype, x.boolean)


def _stacked(it: Interpreter, rows: list[Value], aval: Any) -> Value:
    """A scan's per-iteration outputs stacked along a new first axis."""
    if not any(isinstance(r, Secret) for r in rows):
        return jnp.stack(rows) if rows else jnp.zeros(aval.shape, aval.dtype)
    boolean = all(isinstance(r, Secret) and r.boolean for r in rows)
    shares = [r.shares if boolean else it.arith(r, aval.dtype) for r in rows]
    stacked = it.protocol.local(lambda *parts: jnp.stack(parts), *shares)
    return Secret(stacked, tuple(aval.shape), np.dtype(aval.dtype), boolean)
