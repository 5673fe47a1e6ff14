"""Bitwise logic on secrets.

Bools are XOR shares of bit 0: XOR and NOT are local; AND is one round of ABY3's boolean
product (1 byte per element per party); AND and OR over an axis are trees of ceil(log2 n) such
rounds.

Integers of w bits (int8 to uint64) are held as arithmetic shares; bitwise logic decomposes
them into XOR shares of their w bits (`low_bits`: a carry-save and Kogge-Stone adder, 2 +
ceil(log2 w) rounds), works on the bits (XOR local, AND one round, a public operand local)
and converts back by turning each bit arithmetic (3 rounds, 2 products per bit) and weighing
it, the top bit by -2^(w-1) for signed types: the dtype's own two's complement, wrapped as JAX
wraps. `not` is -1 - x, `shift_left` a product by 2^k (both local); `shift_right_logical` and
`shift_right_arithmetic` by public amounts and `population_count` reweigh the bits.

Shifts by a secret amount (or public amounts that differ per element): the amount's one-hot
over [0, w) (its log2(w) low bits, one product per entry), zeroed outside [0, w) (two
comparisons). A left shift multiplies x by sum_k onehot_k 2^k (one product); a right shift
takes, for each result bit j, sum_k onehot_k bit_{j+k} (one dot product per bit: x's bits
decomposed and made arithmetic, past the top the sign bit (arithmetic) or 0 (logical)). An
amount outside [0, w) gives 0, or the sign fill for an arithmetic right shift, as XLA does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc import ring
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.secret import UNSUPPORTED_HINT, Secret, Value, broadcast_shares, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


def not_bit(self: Interpreter, bits: Shares) -> Shares:
    return self.protocol.xor_public(self.ctx, bits, jnp.uint64(1))


def require_bool(self: Interpreter, eqn: JaxprEqn) -> None:
    if out_aval(eqn).dtype != jnp.bool_:
        raise TraceError(
            f"{self.where}: {eqn.primitive.name} on secret {out_aval(eqn).dtype} is supported "
            f"only on bools; {UNSUPPORTED_HINT}"
        )


def width_of(dtype: Any) -> int:
    return int(np.dtype(dtype).itemsize * 8)


def word_bits(self: Interpreter, x: Value, dtype: Any, shape: Sequence[int]) -> Shares:
    """XOR shares of the w low bits of an integer (w its dtype's width), as one word."""
    width = width_of(dtype)
    if isinstance(x, Secret):
        shares = broadcast_shares(self.arith(x, dtype), shape)
        return self.protocol.low_bits(self.ctx, shares, width)
    public = jnp.broadcast_to(ring.to_ring(jnp.asarray(x)), shape) & _mask(width)
    return self.protocol.lift(self.ctx, public)


def from_bits(self: Interpreter, bits: Shares, dtype: Any, weights: Sequence[int]) -> Shares:
    """Arithmetic shares of sum_j weights[j] * bit_j of XOR-shared bits (weights in the ring,
    negative ones as two's complement)."""
    digits = bit_digits(self, bits, len(weights))
    scale = np.asarray([w & 0xFFFFFFFFFFFFFFFF for w in weights], np.uint64)
    scale = scale.reshape(len(weights), *([1] * (digits.ndim - 2)))
    return jnp.sum(digits * scale, axis=1, dtype=ring.RING)


def bit_digits(self: Interpreter, bits: Shares, width: int) -> Shares:
    """Arithmetic 0/1 shares (2, width, ...) of the `width` low XOR-shared bits, lowest first:
    one batched bit-to-arithmetic conversion (3 rounds)."""
    planes = jnp.stack([(bits >> np.uint64(j)) & np.uint64(1) for j in range(width)], axis=1)
    return self.protocol.b2a(self.ctx, planes)


def index_digits(self: Interpreter, index: Shares, n: int) -> list[Shares]:
    """The binary digits, lowest first, of a secret index into n positions (its
    ceil(log2 n) low bits decomposed, then made arithmetic)."""
    width = max(1, (n - 1).bit_length())
    digits = bit_digits(self, self.protocol.low_bits(self.ctx, index, width), width)
    return [digits[:, j] for j in range(width)]


def one_hot(self: Interpreter, digits: list[Shares], shape: tuple[int, ...]) -> Shares:
    """Arithmetic one-hot (2, *shape, 2^len(digits)) of the number whose binary digits, lowest
    first, are the arithmetic 0/1 shares `digits`: one product per entry, a round per digit
    after the first."""
    onehot = self.protocol.lift(self.ctx, jnp.ones((*shape, 1), ring.RING))
    if not digits:
        return onehot
    first = digits[0]
    onehot = jnp.concatenate([onehot - first[..., None], first[..., None]], axis=-1)
    for digit in digits[1:]:
        spread = jnp.broadcast_to(digit[..., None], onehot.shape)
        upper = self.protocol.mul(self.ctx, onehot, spread)
        onehot = jnp.concatenate([onehot - upper, upper], axis=-1)
    return onehot


def value_weights(dtype: Any) -> list[int]:
    """Each bit's weight in a `dtype` value: 2^j, the top one -2^(w-1) when signed."""
    width = width_of(dtype)
    weights = [1 << j for j in range(width)]
    if jnp.issubdtype(dtype, jnp.signedinteger):
        weights[-1] = -weights[-1]
    return weights


def _mask(width: int) -> np.uint64:
    return np.uint64((1 << width) - 1)


@rule("and", "or", "xor")
def _logic(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    aval = out_aval(eqn)
    if aval.dtype != jnp.bool_:
        return self.out(eqn, _integer_logic(self, eqn.primitive.name, values, aval))
    shape = aval.shape
    a, b = (broadcast_shares(s, shape) for s in map(self.boolean, values))
    if eqn.primitive.name == "xor":
        return self.out(eqn, a ^ b, boolean=True)
    both = self.protocol.and_(self.ctx, a, b, bits=1)
    return self.out(eqn, both if eqn.primitive.name == "and" else a ^ b ^ both, boolean=True)


@rule("reduce_and", "reduce_or")
def _reduce_logic(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """`jnp.all` / `jnp.any` over `axes`: an AND tree over XOR-shared bits, ceil(log2 n)
    rounds (OR as NOT AND NOT)."""
    require_bool(self, eqn)
    (x,) = values
    axes = tuple(eqn.params["axes"])
    kept = [d for d in range(len(x.shape)) if d not in axes]
    count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    is_or = eqn.primitive.name == "reduce_or"
    if count == 0:  # the empty AND is true, the empty OR false
        return jnp.full(out_aval(eqn).shape, not is_or)

    def flatten(s: jnp.ndarray) -> jnp.ndarray:
        moved = jnp.transpose(s, [*kept, *axes])
        return moved.reshape(*(x.shape[d] for d in kept), count)

    bits = self.protocol.local(flatten, self.boolean(x))
    if is_or:
        bits = not_bit(self, bits)
    while count > 1:
        half = count // 2
        low = self.protocol.local(lambda s, h=half: s[..., :h], bits)
        high = self.protocol.local(lambda s, h=half: s[..., h : 2 * h], bits)
        rest = self.protocol.local(lambda s, h=half: s[..., 2 * h :], bits)
        both = self.protocol.and_(self.ctx, low, high, bits=1)
        bits = self.protocol.local(lambda a, b: jnp.concatenate([a, b], axis=-1), both, rest)
        count = half + count % 2
    out = self.protocol.local(lambda s: s[..., 0], bits)
    return self.out(eqn, not_bit(self, out) if is_or else out, boolean=True)


def _integer_logic(self: Interpreter, name: str, values: list[Value], aval: Any) -> Shares:
    """and/or/xor of integers through their bits; a public operand's bits stay public, and
    an AND with a public mask needs only the bits up to the mask's highest (`x & 1`, the
    parity: 2 rounds, then 2 to arithmetic)."""
    secret = [v for v in values if isinstance(v, Secret)]
    public = [v for v in values if not isinstance(v, Secret)]
    if name == "and" and public and not isinstance(public[0], jax.core.Tracer):
        ones = np.asarray(public[0]).astype(np.int64).astype(np.uint64) & _mask(
            width_of(aval.dtype)
        )
        low = int(ones.max(initial=0)).bit_length()
        if low < width_of(aval.dtype):
            shares = self.arith(secret[0], aval.dtype, aval.shape)
            bits = self.protocol.low_bits(self.ctx, shares, max(low, 1))
            kept = self.protocol.local(lambda s: s & jnp.broadcast_to(ones, aval.shape), bits)
            return from_bits(self, kept, aval.dtype, [1 << j for j in range(max(low, 1))])
    bits = word_bits(self, secret[0], aval.dtype, aval.shape)
    if public:
        mask = jnp.broadcast_to(ring.to_ring(jnp.asarray(public[0])), aval.shape)
        mask = mask & _mask(width_of(aval.dtype))
        both = self.protocol.local(lambda s: s & mask, bits)
        other = self.protocol.lift(self.ctx, mask)
    else:
        other = word_bits(self, secret[1], aval.dtype, aval.shape)
        both = self.protocol.and_(self.ctx, bits, other, bits=width_of(aval.dtype))
    result = {"and": both, "xor": bits ^ other, "or": bits ^ other ^ both}[name]
    return from_bits(self, result, aval.dtype, value_weights(aval.dtype))


@rule("reduce_xor")
def _reduce_xor(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """XOR over axes of bools: the parity of each share's bits, local."""
    require_bool(self, eqn)
    axes = tuple(eqn.params["axes"])
    bits = self.boolean(values[0])
    parity = self.protocol.local(
        lambda s: jnp.sum(s & np.uint64(1), axis=axes, dtype=ring.RING) & np.uint64(1), bits
    )
    return self.out(eqn, parity, boolean=True)


@rule("not")
def _logical_not(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    aval = out_aval(eqn)
    if aval.dtype != jnp.bool_:  # ~x = -1 - x (2^w - 1 - x unsigned), local
        top = (
            -1 if jnp.issubdtype(aval.dtype, jnp.signedinteger) else (1 << width_of(aval.dtype)) - 1
        )
        ones = self.protocol.lift(
            self.ctx, jnp.full(aval.shape, np.uint64(top & 0xFFFFFFFFFFFFFFFF))
        )
        return self.out(eqn, ones - self.arith(values[0], aval.dtype))
    return self.out(eqn, not_bit(self, self.boolean(values[0])), boolean=True)


@rule("shift_left", "shift_right_logical", "shift_right_arithmetic")
def _shift(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, amount = values
    aval = out_aval(eqn)
    name = eqn.primitive.name
    if isinstance(amount, jax.core.Tracer):
        raise TraceError(
            f"{self.where}: {name} by a traced amount (a loop's counter, say) is not "
            f"supported; {UNSUPPORTED_HINT}"
        )
    if isinstance(amount, Secret) or np.unique(np.asarray(amount)).size > 1:
        return self.out(eqn, _variable_shift(self, name, x, amount, aval))
    shifts = np.broadcast_to(np.asarray(amount, np.int64), aval.shape)
    k = int(shifts.reshape(-1)[0]) if shifts.size else 0
    width = width_of(aval.dtype)
    shares = self.arith(x, aval.dtype, aval.shape)
    if name == "shift_left":
        factor = np.uint64((1 << k) & 0xFFFFFFFFFFFFFFFF) if 0 <= k < width else np.uint64(0)
        return self.out(eqn, shares * factor)
    if k == 0:
        return self.out(eqn, shares)
    arithmetic = name == "shift_right_arithmetic"
    weights = value_weights(aval.dtype) if arithmetic else [1 << j for j in range(width)]
    k = min(max(k, 0), width - (1 if arithmetic else 0))
    if k >= width:  # a logical shift past the width is 0
        return self.out(eqn, shares - shares)
    shifted = [0] * k + [w >> k if w > 0 else -((-w) >> k) for w in weights[k:]]
    bits = self.protocol.low_bits(self.ctx, shares, width)
    return self.out(eqn, from_bits(self, bits, aval.dtype, shifted))


def _variable_shift(self: Interpreter, name: str, x: Value, amount: Value, aval: Any) -> Shares:
    """x shifted by per-element (secret or public) amounts; see the module docstring."""
    width = width_of(aval.dtype)
    shape = tuple(aval.shape)
    (inside,) = self.eval_as(lambda v: (v >= 0) & (v < width), [amount])
    steps = self.arith(amount, np.int64, shape)
    onehot = one_hot(self, index_digits(self, steps, width), shape)  # (2, *shape, width)
    kept = self.arith(inside, np.int64, shape)
    onehot = self.protocol.mul(self.ctx, onehot, jnp.broadcast_to(kept[..., None], onehot.shape))
    shares = self.arith(x, aval.dtype, shape)
    if name == "shift_left":
        powers = np.asarray([1 << k for k in range(width)], np.uint64)
        factor = jnp.sum(onehot * powers, axis=-1, dtype=ring.RING)
        return self.protocol.mul(self.ctx, shares, factor)
    digits = jnp.moveaxis(
        bit_digits(self, self.protocol.low_bits(self.ctx, shares, width), width), 1, -1
    )
    arithmetic = name == "shift_right_arithmetic"
    top = digits[..., width - 1 : width] if arithmetic else jnp.zeros_like(digits[..., :1])
    extended = jnp.concatenate([digits, jnp.repeat(top, width, axis=-1)], axis=-1)
    window = np.arange(width)[:, None] + np.arange(width)[None, :]  # [j, k] -> bit j + k
    moved = extended[..., window]  # (2, *shape, width j, width k)
    batch = tuple(range(len(shape)))
    result_bits = self.protocol.dot_general(
        self.ctx, moved, onehot, (((len(shape) + 1,), (len(shape),)), (batch, batch))
    )  # (2, *shape, width): bit j of the shifted value
    scale = np.asarray([w & 0xFFFFFFFFFFFFFFFF for w in value_weights(aval.dtype)], np.uint64)
    value = jnp.sum(result_bits * scale, axis=-1, dtype=ring.RING)
    if not arithmetic:
        return value
    # outside [0, w): the sign fill, -1 for a negative x
    outside = self.protocol.lift(self.ctx, jnp.ones(shape, ring.RING)) - kept
    return value - self.protocol.mul(self.ctx, outside, digits[..., width - 1])


@rule("population_count")
def _population_count(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    aval = out_aval(eqn)
    width = width_of(aval.dtype)
    bits = self.protocol.low_bits(self.ctx, self.arith(x, aval.dtype), width)
    return self.out(eqn, from_bits(self, bits, aval.dtype, [1] * width))
