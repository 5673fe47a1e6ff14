"""ABY3: semi-honest 3-party replicated secret sharing over Z_2^64 (Araki, Furukawa, Lindell,
Nof and Ohara, CCS 2016; Mohassel and Rindal, ABY3, CCS 2018).

x = x0 + x1 + x2 (arithmetic) or x0 ^ x1 ^ x2 (boolean); role i holds (x_i, x_{i+1}) as one
uint64[2, ...] array. Role i also holds PRF keys k_i and k_{i+1}, so each pair of roles shares
a key and every zero-sharing is free. Costs, per party and output element (k = ring bits):
  add, sub, public ops, reshape and friends   local
  mul, dot_general, AND                       1 round, k bits (one message to role i-1)
  trunc (ABY3 share truncation I)             1 round, k bits from role 1 to role 0 only
  msb (sign; carry-save + Kogge-Stone)        8 rounds, about 264 bits
  b2a of one bit (two XORs as products)       2 rounds, 2k bits
Threat model: one semi-honest corrupted party learns nothing (its view is uniform given its
input and output); two colluding parties learn everything. See docs/mpc.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpplug.frontend.primitives import converge, prand, prank, run_jax, run_jax_at, shuffle_static
from mpplug.frontend.tracer import TracedValue
from mpplug.mpc import ring
from mpplug.mpc.prf import KEY_WORDS, prf
from mpplug.mpc.protocol import Context, Protocol, Shares
from mpplug.mpc.rounds import exchange

_FROM_NEXT = (1, 2, 0)
"""Role i receives role i+1's value: the reshare after a product."""
_DTYPE_OF_BITS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}
_EVEN_MASKS = (
    0x5555555555555555,
    0x3333333333333333,
    0x0F0F0F0F0F0F0F0F,
    0x00FF00FF00FF00FF,
    0x0000FFFF0000FFFF,
    0x00000000FFFFFFFF,
)


def _u64(value: int) -> np.uint64:
    return np.uint64(value & 0xFFFFFFFFFFFFFFFF)


def _compress_even(x: jnp.ndarray, width: int) -> jnp.ndarray:
    """The even-position bits of the low `width` bits of x, packed into width/2 bits
    (a bit permutation, so it applies share by share to boolean shares)."""
    x = x & _u64(_EVEN_MASKS[0])
    step = 1
    for mask in _EVEN_MASKS[1:]:
        if step >= width // 2:
            break
        x = (x | (x >> np.uint64(step))) & _u64(mask)
        step *= 2
    return x


class ABY3(Protocol):
    name = "aby3"
    n_parties = 3

    # -- program level ---------------------------------------------------------------------

    def setup(self, parties: Sequence[int]) -> list[TracedValue]:
        own = prand((KEY_WORDS,), parties=list(parties))
        routes: dict[int | str, int | str] = {parties[i]: parties[(i + 1) % 3] for i in range(3)}
        following = shuffle_static(own, routes)
        roles = np.full(max(parties) + 1, -1, np.int32)
        roles[list(parties)] = np.arange(3, dtype=np.int32)

        def context(rank: jnp.ndarray, mine: jnp.ndarray, theirs: jnp.ndarray) -> Any:
            return jnp.asarray(roles)[rank], jnp.stack([mine, theirs])

        role, keys = run_jax(context, prank(parties=list(parties)), own, following)
        return [role, keys]

    def share(
        self, x: TracedValue, owner: int, parties: Sequence[int], encode: Callable[[Any], Any]
    ) -> TracedValue:
        seed = prand((KEY_WORDS,), parties=[owner])

        def split(value: jnp.ndarray, seed: jnp.ndarray) -> list[jnp.ndarray]:
            v = encode(value)
            x0, x1 = prf(seed, 0, v.shape), prf(seed, 1, v.shape)
            parts = [x0, x1, v - x0 - x1]
            return [jnp.stack([parts[i], parts[(i + 1) % 3]]) for i in range(3)]

        with jax.enable_x64(True):
            pairs = run_jax_at(owner, split, x, seed)
        placed = [
            pair if party == owner else shuffle_static(pair, {party: owner})
            for party, pair in zip(parties, pairs, strict=True)
        ]
        return converge(*placed)

    def open(
        self,
        shares: TracedValue,
        boolean: bool,
        parties: Sequence[int],
        to: Sequence[int],
        decode: Callable[[Any], Any],
    ) -> TracedValue:
        with jax.enable_x64(True):
            first = run_jax(lambda s: s[0], shares)
        missing: dict[int | str, int | str] = {}
        pair_from: dict[int | str, int | str] = {}
        for t in to:
            if t in parties:
                role = list(parties).index(t)
                missing[t] = parties[(role + 2) % 3]
                pair_from[t] = t
            else:
                missing[t], pair_from[t] = parties[2], parties[0]
        third = shuffle_static(first, dict(missing))
        pair = shuffle_static(shares, dict(pair_from))

        def combine(pair: jnp.ndarray, third: jnp.ndarray) -> jnp.ndarray:
            value = pair[0] ^ pair[1] ^ third if boolean else pair[0] + pair[1] + third
            return decode(value)

        with jax.enable_x64(True):
            return run_jax(combine, pair, third)

    # -- inside a share program --------------------------------------------------------------

    def shares_aval(self, shape: Sequence[int]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((2, *shape), ring.RING)

    def lift(self, ctx: Context, value: jnp.ndarray) -> Shares:
        zero = jnp.zeros_like(value)
        return jnp.stack(
            [jnp.where(ctx.role == 0, value, zero), jnp.where(ctx.role == 2, value, zero)]
        )

    def local(self, fn: Callable[..., jnp.ndarray], *shares: Shares) -> Shares:
        return jnp.stack([fn(*(s[0] for s in shares)), fn(*(s[1] for s in shares))])

    def _zero(self, ctx: Context, shape: Sequence[int]) -> jnp.ndarray:
        """Arithmetic shares of zero: F(k_i) - F(k_{i+1}) sums to 0 over the roles."""
        stream = ctx.next_stream()
        return prf(ctx.keys[0], stream, shape) - prf(ctx.keys[1], stream, shape)

    def _zero_bits(self, ctx: Context, shape: Sequence[int], dtype: Any) -> jnp.ndarray:
        """XOR shares of zero in `dtype` words (narrow words take fewer PRF words)."""
        per_word = 8 // jnp.dtype(dtype).itemsize
        count = -(-math.prod(shape) // per_word)
        stream = ctx.next_stream()
        words = prf(ctx.keys[0], stream, (count,)) ^ prf(ctx.keys[1], stream, (count,))
        narrow = lax.bitcast_convert_type(words, dtype).reshape(-1) if per_word > 1 else words
        return narrow[: math.prod(shape)].reshape(tuple(shape))

    def _pair_random(self, ctx: Context, shape: Sequence[int], owner_role: int) -> jnp.ndarray:
        """Randomness known to roles owner_role - 1 and owner_role (from key k_owner)."""
        key = jnp.where(ctx.role == owner_role, ctx.keys[0], ctx.keys[1])
        return prf(key, ctx.next_stream(), shape)

    def _reshare(self, ctx: Context, z: jnp.ndarray, tag: str) -> Shares:
        return jnp.stack([z, exchange(z, _FROM_NEXT, tag)])

    def mul(self, ctx: Context, a: Shares, b: Shares) -> Shares:
        z = a[0] * b[0] + a[0] * b[1] + a[1] * b[0]
        return self._reshare(ctx, z + self._zero(ctx, z.shape), "mul.reshare")

    def dot_general(self, ctx: Context, a: Shares, b: Shares, dimension_numbers: Any) -> Shares:
        z = ring.dot_general(a[0] + a[1], b[0], dimension_numbers)
        z = z + ring.dot_general(a[0], b[1], dimension_numbers)
        return self._reshare(ctx, z + self._zero(ctx, z.shape), "dot.reshare")

    def trunc(self, ctx: Context, a: Shares, bits: int) -> Shares:
        # ABY3 share truncation I (Mohassel-Rindal 2018, section 5.1.1), as in SPU's TruncA:
        # role 1 truncates x1 + x2 (rounding up), role 0 and 2 truncate x0 (rounding down);
        # role 1 masks its part with r from k2 and sends it to role 0.
        r = self._pair_random(ctx, a.shape[1:], owner_role=2)
        upper = -ring.arshift(-(a[0] + a[1]), bits) - r
        sent = exchange(upper, (1, 1, 2), "trunc")
        own = jnp.where(ctx.role == 0, ring.arshift(a[0], bits), jnp.where(ctx.role == 1, sent, r))
        nxt = jnp.where(ctx.role == 0, sent, jnp.where(ctx.role == 1, r, ring.arshift(a[1], bits)))
        return jnp.stack([own, nxt])

    def xor_public(self, ctx: Context, a: Shares, mask: Any) -> Shares:
        return a ^ self.lift(ctx, jnp.broadcast_to(mask, a.shape[1:]).astype(a.dtype))

    def and_(self, ctx: Context, a: Shares, b: Shares, bits: int = 64) -> Shares:
        dtype = _DTYPE_OF_BITS[max(8, 1 << max(0, bits - 1).bit_length())]
        a, b = a.astype(dtype), b.astype(dtype)
        z = (a[0] & b[0]) ^ (a[0] & b[1]) ^ (a[1] & b[0])
        z = z ^ self._zero_bits(ctx, z.shape, dtype)
        return self._reshare(ctx, z, "and.reshare").astype(ring.RING)

    def msb(self, ctx: Context, a: Shares) -> Shares:
        x0, x1, x2 = (self.lift_slot(ctx, a, j) for j in range(3))
        s = x0 ^ x1 ^ x2
        carry = self.and_(ctx, x0 ^ x2, x1 ^ x2) ^ x2  # majority: the carry-save adder's carries
        c = carry << np.uint64(1)
        top = ((s ^ c) >> np.uint64(63)) & np.uint64(1)
        # Carry into bit 63 of s + c: the group generate of bits 0..62, by Kogge-Stone
        # reduction; bit 63 gets (generate 0, propagate 1) so the group over 64 bits is it.
        high = _u64(1 << 63)
        g = self.and_(ctx, s, c) & ~high
        p = self.xor_public(ctx, (s ^ c) & ~high, high)
        width = 64
        while width > 1:
            half = width // 2
            g_lo, g_hi = _compress_even(g, width), _compress_even(g >> np.uint64(1), width)
            p_lo, p_hi = _compress_even(p, width), _compress_even(p >> np.uint64(1), width)
            both = self.and_(
                ctx, p_hi | (p_hi << np.uint64(half)), g_lo | (p_lo << np.uint64(half)), width
            )
            lane = _u64((1 << half) - 1)
            g = g_hi ^ (both & lane)
            p = (both >> np.uint64(half)) & lane
            width = half
        return (top ^ g) & np.uint64(1)

    def b2a(self, ctx: Context, bit: Shares) -> Shares:
        b0, b1, b2 = (self.lift_slot(ctx, bit & np.uint64(1), j) for j in range(3))
        t = b0 + b1 - (self.mul(ctx, b0, b1) << np.uint64(1))
        return t + b2 - (self.mul(ctx, t, b2) << np.uint64(1))

    def lift_slot(self, ctx: Context, a: Shares, j: int) -> Shares:
        """Share x_j of `a` alone, as shares of the same kind (its two holders know it)."""
        zero = jnp.zeros_like(a[0])
        return jnp.stack(
            [
                jnp.where(ctx.role == j, a[0], zero),
                jnp.where(ctx.role == (j - 1) % 3, a[1], zero),
            ]
        )
