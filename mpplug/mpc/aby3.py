"""ABY3: semi-honest 3-party replicated secret sharing over Z_2^64 (Araki, Furukawa, Lindell,
Nof and Ohara, CCS 2016; Mohassel and Rindal, ABY3, CCS 2018).

x = x0 + x1 + x2 (arithmetic) or x0 ^ x1 ^ x2 (boolean); role i holds (x_i, x_{i+1}) as one
uint64[2, ...] array. Role i also holds PRF keys k_i and k_{i+1}, so each pair of roles shares
a key and every zero-sharing is free. Costs, per output element (k = 64 ring bits, w = 32 bits
for truncations by at most 32 bits, else 64), as rounds and bits sent by roles (0, 1, 2):
  add, sub, public ops, reshape and friends   local
  mul, dot_general, AND                       1 round, (k, k, k)
  AND of values of b <= 4 bits                1 round, b rounded up to 1, 2 or 4 bits,
                                              packed 8, 4 or 2 to a byte
  trunc, precise (default)                    2 rounds, (w + k, w + k, w)
  mul or dot_general then precise trunc       3 rounds, (w + k, w + k, k + w): fused
  trunc, probabilistic (ABY3 truncation I)    1 round, (0, k, 0)
  msb (sign; carry-save + Kogge-Stone)        8 rounds, 254 bits
  shuffle (a secret permutation)              2 rounds, (k, k, 2k)
  open a bit to every role                    1 round, 1 bit from each role
  b2a of one bit (two XORs as products)       2 rounds, 2k bits
Threat model: one semi-honest corrupted party learns nothing (its view is uniform given its
input and output); two colluding parties learn everything. See docs/mpc.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpplug.core import TensorType
from mpplug.frontend.jax_export import function_name
from mpplug.frontend.primitives import (
    converge,
    prand,
    prank,
    run_jax,
    run_jax_at,
    run_pfunc,
    shuffle_static,
)
from mpplug.frontend.tracer import TracedValue, current_builder
from mpplug.kernels.keystream import BLOCK_WORDS_64, keystream_pfunction
from mpplug.mpc import emit, ring, trace_cache
from mpplug.mpc.prf import KEY_WORDS, blocks_for, prf, stream_view
from mpplug.mpc.protocol import Context, Protocol, Shares
from mpplug.mpc.rounds import exchange
from mpplug.mpc.spliced import traced_once

_FROM_NEXT = (1, 2, 0)
"""Role i receives role i+1's value: the reshare after a product."""
_SWAP_01 = (1, 0, 2)
"""Roles 0 and 1 swap values; role 2 keeps its own."""
_TO_1_FROM_2 = (0, 2, 2)
"""Role 1 receives role 2's value."""
_QUARTER, _HALF = 1 << 62, 1 << 63
"""L/4 and L/2 for the ring Z_L, L = 2^64: precise truncation needs |x| < L/4."""
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


def _words_for(shape: Sequence[int], dtype: Any) -> tuple[int]:
    """How many uint64 PRF words hold `shape` elements of `dtype`."""
    return (-(-math.prod(shape) // (8 // jnp.dtype(dtype).itemsize)),)


def _narrow(words: jnp.ndarray, shape: Sequence[int], dtype: Any) -> jnp.ndarray:
    """uint64 PRF words as `shape` elements of the unsigned `dtype`."""
    if jnp.dtype(dtype).itemsize < 8:
        narrow = lax.bitcast_convert_type(words, dtype)
        words = lax.reshape(narrow, (narrow.size,))
    size = math.prod(shape)
    if words.shape[0] != size:
        words = lax.slice(words, (0,), (size,))
    return lax.reshape(words, tuple(shape))


def _flat_padded(a: Shares, size: int) -> Shares:
    """A party's two shares of `a`, flat, with zeros after them up to `size` elements."""
    flat = lax.reshape(a, (2, math.prod(a.shape[1:])))
    if flat.shape[1] == size:
        return flat
    zero = np.zeros((), a.dtype)
    return lax.pad(flat, zero, [(0, 0, 0), (0, size - flat.shape[1], 0)])


def _packed(lanes_of: jnp.ndarray, lanes: int) -> jnp.ndarray:
    """uint8 values of `lanes` bits (a flat vector, its size a multiple of 8 // lanes), 8 //
    lanes to a byte, the first in the low bits."""
    per = 8 // lanes
    rows = lax.reshape(lanes_of, (lanes_of.shape[0] // per, per))
    shifts = np.arange(0, 8, lanes, dtype=np.uint8)
    spread = lax.shift_left(rows, lax.broadcast_in_dim(shifts, rows.shape, (1,)))
    return lax.reduce_or(spread, (1,))


def _unpacked(packed: jnp.ndarray, lanes: int) -> jnp.ndarray:
    """The values `_packed` packed."""
    per = 8 // lanes
    shape = (packed.shape[0], per)
    shifts = lax.broadcast_in_dim(np.arange(0, 8, lanes, dtype=np.uint8), shape, (1,))
    values = lax.shift_right_logical(lax.broadcast_in_dim(packed, shape, (0,)), shifts)
    lanes_mask = np.uint8((1 << lanes) - 1)
    return lax.reshape(lax.bitwise_and(values, lanes_mask), (packed.shape[0] * per,))


def _halves(a: Shares) -> tuple[jnp.ndarray, jnp.ndarray]:
    """A party's two shares, as `a[0], a[1]` in one equation instead of four (a share program
    reads shares thousands of times, and tracing its equations is most of its cost)."""
    first, second = lax.unstack(a, 0)
    return first, second


def _pair(first: jnp.ndarray, second: jnp.ndarray) -> Shares:
    return lax.stack([first, second])


def _by_role(ctx: Context, *cases: jnp.ndarray) -> jnp.ndarray:
    """`cases[r]` at the party whose role is r (one select where jnp.where takes several)."""
    return lax.select_n(ctx.role, *cases)


def _if_role(ctx: Context, role: int, then: jnp.ndarray, other: jnp.ndarray) -> jnp.ndarray:
    """`then` at the party whose role is `role`, `other` at the others."""
    return lax.select(ctx.is_role(role), then, other)


def _compress_even(x: jnp.ndarray, width: int) -> jnp.ndarray:
    """The even-position bits of the low `width` bits of x, packed into width/2 bits
    (a bit permutation, so it applies share by share to boolean shares)."""
    x = lax.bitwise_and(x, _u64(_EVEN_MASKS[0]))
    step = 1
    for mask in _EVEN_MASKS[1:]:
        if step >= width // 2:
            break
        x = lax.bitwise_and(
            lax.bitwise_or(x, lax.shift_right_logical(x, np.uint64(step))), _u64(mask)
        )
        step *= 2
    return x


def _local(
    fn: Callable[..., Any], *args: TracedValue, recipe: Hashable, at: int | None = None
) -> Any:
    """`fn` run (with 64-bit types) where all of `args` are held, or at party `at`: a module
    written from its jaxpr by `emit` (a few ms), or where that cannot be, exported by
    `jax.export` (tens of ms). `recipe` names all `fn` computes besides its arguments' types:
    the module is kept by it (`trace_cache.local_function`), and not traced again."""
    types = [a.type for a in args]
    assert all(isinstance(t, TensorType) for t in types), types  # shares are tensors
    platforms = current_builder("mpc").platforms

    def make() -> trace_cache.Local | None:
        specs = [jax.ShapeDtypeStruct(t.shape, t.dtype.numpy) for t in types]  # type: ignore[union-attr]
        with jax.enable_x64(True):
            closed, shape = jax.make_jaxpr(fn, return_shape=True)(*specs)
            try:
                pfunc = emit.jaxpr_function(function_name(fn), closed, platforms)
            except emit.Unemittable:
                return None
        return pfunc, isinstance(shape, jax.ShapeDtypeStruct)

    found = trace_cache.local_function((ABY3.name, recipe), types, platforms, make)
    if found is None:
        return run_jax(fn, *args) if at is None else run_jax_at(at, fn, *args)
    pfunc, single = found
    outs = run_pfunc(pfunc, *args, parties=None if at is None else [at])
    return outs[0] if single else outs


def first_share(pair: jnp.ndarray) -> jnp.ndarray:
    """A party's first share x_i, the one the role before it lacks."""
    return pair[0]


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

        role, keys = _local(
            context,
            prank(parties=list(parties)),
            own,
            following,
            recipe=("context", *roles.tolist()),
        )
        return [role, keys]

    def share(
        self, x: TracedValue, owner: int, parties: Sequence[int], encode: ring.Encoding
    ) -> TracedValue:
        keys = prand((2, KEY_WORDS), parties=[owner])  # fresh keys of x0's and x1's streams
        count = blocks_for(x.shape)
        draw = keystream_pfunction([0, 1], [count, count], [[1, 1]])
        (words,) = run_pfunc(draw, keys, parties=[owner])

        def split(value: jnp.ndarray, words: jnp.ndarray) -> list[jnp.ndarray]:
            v = encode(value)
            x0 = stream_view(words, 0, v.shape)
            x1 = stream_view(words, count * BLOCK_WORDS_64, v.shape)
            parts = [x0, x1, v - x0 - x1]
            return [jnp.stack([parts[i], parts[(i + 1) % 3]]) for i in range(3)]

        pairs = _local(split, x, words, at=owner, recipe=("split", encode, count))
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
        decode: ring.Decoding,
    ) -> TracedValue:
        first = _local(first_share, shares, recipe="first")
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

        return _local(combine, pair, third, recipe=("combine", boolean, decode))

    # -- inside a share program --------------------------------------------------------------

    def shares_aval(self, shape: Sequence[int]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((2, *shape), ring.RING)

    def lift(self, ctx: Context, value: jnp.ndarray) -> Shares:
        zero = jnp.zeros_like(value)
        return _pair(_if_role(ctx, 0, value, zero), _if_role(ctx, 2, value, zero))

    def local(self, fn: Callable[..., jnp.ndarray], *shares: Shares) -> Shares:
        halves = [_halves(s) for s in shares]
        return _pair(fn(*(h[0] for h in halves)), fn(*(h[1] for h in halves)))

    def _zero(self, ctx: Context, shape: Sequence[int]) -> jnp.ndarray:
        """Arithmetic shares of zero: F(k_i) - F(k_{i+1}) sums to 0 over the roles."""
        stream = ctx.next_stream()
        mine, theirs = _halves(ctx.keys)
        return lax.sub(prf(mine, stream, shape), prf(theirs, stream, shape))

    def _zero_bits(self, ctx: Context, shape: Sequence[int], dtype: Any) -> jnp.ndarray:
        """XOR shares of zero in `dtype` words (narrow words take fewer PRF words)."""
        stream = ctx.next_stream()
        words = _words_for(shape, dtype)
        mine, theirs = (_narrow(prf(k, stream, words), shape, dtype) for k in _halves(ctx.keys))
        return lax.bitwise_xor(mine, theirs)

    def _pair_random(
        self, ctx: Context, shape: Sequence[int], owner_role: int, dtype: Any = ring.RING
    ) -> jnp.ndarray:
        """Randomness known to roles owner_role - 1 and owner_role (from key k_owner), as
        `dtype` words (narrow words take fewer PRF words)."""
        users = ((owner_role - 1) % 3, owner_role)
        words = prf(
            ctx.keys,  # k_owner: its own key at role owner_role, its next at owner_role - 1
            ctx.next_stream(),
            _words_for(shape, dtype),
            role=ctx.role,
            roles=users,
            pick=owner_role,
        )
        return _narrow(words, shape, dtype)

    def _reshare(self, ctx: Context, z: jnp.ndarray, tag: str) -> Shares:
        return _pair(z, exchange(z, _FROM_NEXT, tag))

    def _cross(self, a: Shares, b: Shares) -> jnp.ndarray:
        """Role i's additive share z_i = a_i b_i + a_i b_i+1 + a_i+1 b_i of the product, as
        (a_i + a_i+1) b_i + a_i b_i+1."""
        (a0, a1), (b0, b1) = _halves(a), _halves(b)
        return lax.add(lax.mul(lax.add(a0, a1), b0), lax.mul(a0, b1))

    @traced_once
    def mul(self, ctx: Context, a: Shares, b: Shares, bits: int = 0) -> Shares:
        return self._finish_product(ctx, self._cross(a, b), bits, "mul")

    def dot_general(
        self, ctx: Context, a: Shares, b: Shares, dimension_numbers: Any, bits: int = 0
    ) -> Shares:
        def product(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
            return ring.dot_general(x, y, dimension_numbers)

        return self.bilinear(ctx, a, b, product, bits, "dot")

    def bilinear(
        self,
        ctx: Context,
        a: Shares,
        b: Shares,
        product: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray],
        bits: int = 0,
        tag: str = "bilinear",
    ) -> Shares:
        # Role i's additive share a_i b_i + a_i b_i+1 + a_i+1 b_i, as two products.
        (a0, a1), (b0, b1) = _halves(a), _halves(b)
        z = lax.add(product(lax.add(a0, a1), b0), product(a0, b1))
        return self._finish_product(ctx, z, bits, tag)

    @traced_once
    def _finish_product(self, ctx: Context, z: jnp.ndarray, bits: int, tag: str) -> Shares:
        """Replicated shares of sum_i z_i, shifted right by `bits` when `bits` > 0."""
        if bits and ctx.truncation == "precise":
            return self._trunc_pair(ctx, self._pair_from_additive(ctx, z), bits)
        product = self._reshare(ctx, lax.add(z, self._zero(ctx, z.shape)), f"{tag}.reshare")
        return self.trunc(ctx, product, bits) if bits else product

    @traced_once
    def trunc(self, ctx: Context, a: Shares, bits: int) -> Shares:
        if ctx.truncation == "probabilistic":
            return self._trunc_probabilistic(ctx, a, bits)
        # Replicated to two-out-of-two between roles 0 and 1: x0 + x1 at role 0, x2 at role 1.
        a0, a1 = _halves(a)
        return self._trunc_pair(ctx, _if_role(ctx, 0, lax.add(a0, a1), a1), bits)

    def _trunc_probabilistic(self, ctx: Context, a: Shares, bits: int) -> Shares:
        # ABY3 share truncation I (Mohassel-Rindal 2018, section 5.1.1), as in SPU's TruncA:
        # role 1 truncates x1 + x2 (rounding up), role 0 and 2 truncate x0 (rounding down);
        # role 1 masks its part with r from k2 and sends it to role 0. Wrong by about 2^(64-bits)
        # with probability about |x| / 2^63.
        r = self._pair_random(ctx, a.shape[1:], owner_role=2)
        a0, a1 = _halves(a)
        upper = -ring.arshift(-(a0 + a1), bits) - r
        sent = exchange(upper, (1, 1, 2), "trunc")
        own = _by_role(ctx, ring.arshift(a0, bits), sent, r)
        nxt = _by_role(ctx, sent, r, ring.arshift(a1, bits))
        return _pair(own, nxt)

    def _pair_from_additive(self, ctx: Context, z: jnp.ndarray) -> jnp.ndarray:
        """Three-out-of-three shares z_i (role i knows z_i) to two-out-of-two between roles 0
        and 1: role 2 sends z2 - r to role 1, with r from k0 (known to roles 2 and 0, never to
        role 1). One round, k bits from role 2; it replaces a product's reshare."""
        r = self._pair_random(ctx, z.shape, owner_role=0)
        moved = exchange(lax.sub(z, r), _TO_1_FROM_2, "trunc.pair")
        return lax.add(z, _if_role(ctx, 0, r, moved))

    def _bit_product_masks(
        self, ctx: Context, shape: Sequence[int], dtype: Any
    ) -> list[jnp.ndarray]:
        """The dealer's randomness for one private product of role 0's and role 1's bits, in
        `dtype` words: (mask_a, c0) from k0 (roles 2 and 0), mask_b from k2 (roles 1 and 2)."""
        drawn = [self._pair_random(ctx, shape, o, dtype) for o in (0, 0, 2)]
        return [lax.convert_element_type(d, ring.RING) for d in drawn]

    def _trunc_pair(self, ctx: Context, u: jnp.ndarray, bits: int) -> Shares:
        """Precise truncation of x = u0 + u1 (u0 at role 0, u1 at role 1; role 2 helps) for
        |x| < 2^62, back to replicated shares: floor(x / 2^bits) or one more, never further.

        The one-bit-error truncation of "Improved secure two-party computation from a
        geometric perspective" (eprint 2025/200, Algorithm 4; SPU's TruncAPr2 for ABY3). With
        |x| < L/4, the wrap count of u0 + u1 = x + w L is w = [u0 >= L/4] + a b for the bits
        a = [u0 - L/4 >= L/2] (role 0's) and b = [u1 >= L/2] (role 1's), so
        floor(x / 2^m) = (u0 >> m) + (u1 >> m) - w 2^(64-m) + {0, 1}. a b is one private
        product with role 2 as dealer (Beaver's trick on two private bits, in Z_2^w): role 2
        derives a's mask and c0 with role 0 (key k0) and b's mask with role 1 (key k2), and
        sends role 1 c1 = mask_a mask_b - c0 (uniform to role 1, which lacks k0; independent
        of the data, so it travels with role 2's half of a product, see `rounds`). Roles 0
        and 1 swap their masked bits (round 1) and then reshare the two-out-of-two result to
        replicated shares, each masking its half with a key the other lacks (round 2). Costs
        (w + k, w + k, w) bits.
        """
        narrow = jnp.uint32 if bits <= 32 else ring.RING
        shape = u.shape
        first = ctx.is_role(0)
        a = lax.ge(lax.sub(u, _u64(_QUARTER)), _u64(_HALF))
        b = lax.ge(u, _u64(_HALF))
        mine = lax.convert_element_type(lax.select(first, a, b), ring.RING)
        mask_a, c0, mask_b = self._bit_product_masks(ctx, shape, narrow)
        c1 = exchange(
            lax.convert_element_type(lax.sub(lax.mul(mask_a, mask_b), c0), narrow),
            _TO_1_FROM_2,
            "trunc.dealer",
        )
        masked = lax.add(lax.select(first, mask_a, mask_b), mine)
        theirs = lax.convert_element_type(
            exchange(lax.convert_element_type(masked, narrow), _SWAP_01, "trunc.bits"), ring.RING
        )
        product = lax.select(
            first,
            lax.add(lax.mul(mine, theirs), c0),
            lax.sub(lax.convert_element_type(c1, ring.RING), lax.mul(mask_b, theirs)),
        )
        above_quarter = lax.bitwise_and(lax.ge(u, _u64(_QUARTER)), first)
        wraps = lax.add(product, lax.convert_element_type(above_quarter, ring.RING))
        shifted = lax.sub(
            lax.shift_right_logical(u, np.uint64(bits)), lax.shift_left(wraps, np.uint64(64 - bits))
        )
        # + 1 at role 0: floor or one above
        half = lax.add(shifted, lax.convert_element_type(first, ring.RING))
        y0 = self._pair_random(ctx, shape, owner_role=0)  # roles 2 and 0
        y2 = self._pair_random(ctx, shape, owner_role=2)  # roles 1 and 2
        out = lax.sub(half, lax.select(first, y0, y2))
        y1 = lax.add(out, exchange(out, _SWAP_01, "trunc.reshare"))
        return _pair(_by_role(ctx, y0, y1, y2), _by_role(ctx, y1, y2, y0))

    def xor_public(self, ctx: Context, a: Shares, mask: Any) -> Shares:
        public = jnp.broadcast_to(mask, a.shape[1:]).astype(a.dtype)
        return lax.bitwise_xor(a, self.lift(ctx, public))

    @traced_once
    def and_(self, ctx: Context, a: Shares, b: Shares, bits: int = 64) -> Shares:
        lanes = 1 << max(0, bits - 1).bit_length()  # bits, rounded up to a power of two
        dtype = _DTYPE_OF_BITS[max(8, lanes)]
        a, b = (lax.convert_element_type(s, dtype) for s in (a, b))
        shape, size = a.shape[1:], math.prod(a.shape[1:])
        if lanes < 8:  # sent packed, 8 // lanes values to a byte: flat, padded to whole bytes
            padded = -(-size // (8 // lanes)) * (8 // lanes)
            a, b = (_flat_padded(s, padded) for s in (a, b))
        a0, a1 = _halves(a)
        b0, b1 = _halves(b)
        # (a_i & b_i) ^ (a_i & b_i+1) ^ (a_i+1 & b_i)
        z = lax.bitwise_xor(lax.bitwise_and(lax.bitwise_xor(a0, a1), b0), lax.bitwise_and(a0, b1))
        z = lax.bitwise_xor(z, self._zero_bits(ctx, z.shape, dtype))
        if lanes >= 8:
            return lax.convert_element_type(self._reshare(ctx, z, "and.reshare"), ring.RING)
        # each share's bits above `lanes` dropped: the value fits in `bits`, so the shares'
        # XOR keeps it, and each lane of the message is masked by the zero sharing's
        z = lax.bitwise_and(z, np.uint8((1 << lanes) - 1))
        got = exchange(_packed(z, lanes), _FROM_NEXT, "and.reshare")
        both = lax.slice_in_dim(_pair(z, _unpacked(got, lanes)), 0, size, axis=1)
        return lax.convert_element_type(lax.reshape(both, (2, *shape)), ring.RING)

    @traced_once
    def msb(self, ctx: Context, a: Shares, width: int = 64, carry: Shares | None = None) -> Shares:
        # lax calls, not operators: jnp's operators cost several times their work to trace
        xor, both_set, either = lax.bitwise_xor, lax.bitwise_and, lax.bitwise_or
        shl, shr = lax.shift_left, lax.shift_right_logical
        wide = width == 64
        mask = _u64((1 << width) - 1)
        x0, x1, x2 = (
            self.lift_slot(ctx, a, j) if wide else both_set(self.lift_slot(ctx, a, j), mask)
            for j in range(3)
        )
        s = xor(xor(x0, x1), x2)
        # majority: the carry-save adder's carries
        majority = xor(self.and_(ctx, xor(x0, x2), xor(x1, x2), width), x2)
        c = shl(majority, _u64(1)) if wide else both_set(shl(majority, _u64(1)), mask)
        top = both_set(shr(xor(s, c), _u64(width - 1)), _u64(1))
        # Carry into the top bit of s + c: the group generate of the bits below it, by
        # Kogge-Stone reduction; the top bit gets (generate 0, propagate 1) so the group over
        # all `width` bits is it. A carry in enters at bit 0 (c's bit 0 is 0, so bit 0 alone
        # generates s0 & carry): bit 0 also gets propagate 1, the reduction gives the group
        # (G, P) of bits 1..width-2, and the carry is G ^ (P & s0 & carry), two 1-bit ANDs
        # that run beside the reduction instead of a reduction after the carry is known.
        ends = _u64((1 << (width - 1)) | (0 if carry is None else 1))
        g = both_set(self.and_(ctx, s, c, width), ~_u64(1 << (width - 1)))
        p = self.xor_public(ctx, both_set(xor(s, c), ~ends), ends)
        if carry is not None:
            first = self.and_(ctx, both_set(s, _u64(1)), both_set(carry, _u64(1)), bits=1)
        while width > 1:
            half = width // 2
            g_lo, g_hi = _compress_even(g, width), _compress_even(shr(g, _u64(1)), width)
            p_lo, p_hi = _compress_even(p, width), _compress_even(shr(p, _u64(1)), width)
            both = self.and_(
                ctx,
                either(p_hi, shl(p_hi, _u64(half))),
                either(g_lo, shl(p_lo, _u64(half))),
                width,
            )
            lane = _u64((1 << half) - 1)
            g = xor(g_hi, both_set(both, lane))
            p = both_set(shr(both, _u64(half)), lane)
            width = half
        if carry is not None:
            g = xor(g, self.and_(ctx, both_set(p, _u64(1)), first, bits=1))
        return both_set(xor(top, g), _u64(1))

    @traced_once
    def shuffle(self, ctx: Context, a: Shares, blocks: int) -> Shares:
        # Three permutations, each known to two roles: pa to roles 2 and 0 (key k0), pb to 0
        # and 1 (k1), pc to 1 and 2 (k2); every role misses one, so their composition is
        # uniform to it. x = (x0 + x1) + x2 is two-out-of-two between roles 0 and 2; both
        # apply pa. Role 2 hands its part, masked by m1 (k0), to role 1; roles 0 and 1 apply
        # pb; role 0 hands its part, masked by m2 (k1), to role 2 (both in round 1); roles 1
        # and 2 apply pc and reshare to three parts z0 (k0), z1 (k1), z2 (round 2).
        shape = a.shape[1:]
        size = shape[-1] // blocks

        def permutation(owner: int) -> jnp.ndarray:
            words = self._pair_random(ctx, (blocks, size), owner)
            offsets = (jnp.arange(blocks, dtype=jnp.int32) * size)[:, None]
            return (jnp.argsort(words, axis=-1).astype(jnp.int32) + offsets).reshape(-1)

        def apply(x: jnp.ndarray, order: jnp.ndarray) -> jnp.ndarray:
            return jnp.take(x, order, axis=-1)

        pa, pb, pc = permutation(0), permutation(1), permutation(2)
        m1 = self._pair_random(ctx, shape, owner_role=0)
        m2 = self._pair_random(ctx, shape, owner_role=1)
        a0, a1 = _halves(a)
        first = apply(a0 + a1, pa) - m1  # role 0's part, and role 2's (a0 = x2) masked
        handed = _if_role(ctx, 0, apply(first, pb) - m2, apply(a0, pa) + m1)
        got = exchange(handed, (0, 2, 0), "shuffle")  # role 1 gets role 2's, role 2 role 0's
        part = apply(_if_role(ctx, 1, apply(got, pb) + m2, got), pc)
        z0 = self._pair_random(ctx, shape, owner_role=0)
        z1 = self._pair_random(ctx, shape, owner_role=1)
        out = part - _if_role(ctx, 1, z1, z0)
        z2 = out + exchange(out, (0, 2, 1), "shuffle.reshare")
        return _pair(_by_role(ctx, z0, z1, z2), _by_role(ctx, z1, z2, z0))

    @traced_once
    def open_bits(self, ctx: Context, bits: Shares) -> jnp.ndarray:
        # role i holds bits i and i+1 and gets bit i+2 from role i+1, 64 to a word
        shape = bits.shape[1:]
        size = math.prod(shape)
        lanes = jnp.arange(64, dtype=ring.RING)
        words = -(-size // 64)
        mine = jnp.pad((bits[1] & np.uint64(1)).reshape(-1), (0, words * 64 - size))
        packed = jnp.sum(mine.reshape(words, 64) << lanes, axis=1, dtype=ring.RING)
        got = exchange(packed, _FROM_NEXT, "open")
        third = ((got[:, None] >> lanes) & np.uint64(1)).reshape(-1)[:size]
        value = ((bits[0] ^ bits[1]).reshape(-1) ^ third) & np.uint64(1)
        return value.reshape(shape).astype(jnp.bool_)

    @traced_once
    def low_bits(self, ctx: Context, a: Shares, width: int) -> Shares:
        # The carry-save adder of the three shares' low bits, then a Kogge-Stone adder over
        # `width` bits (generate and propagate are never both set: OR is XOR). Rounds:
        # 2 + ceil(log2 width), each an AND of width-bit words.
        mask = _u64((1 << width) - 1)
        x0, x1, x2 = (self.lift_slot(ctx, a, j) & mask for j in range(3))
        s = x0 ^ x1 ^ x2
        c = ((self.and_(ctx, x0 ^ x2, x1 ^ x2, width) ^ x2) << np.uint64(1)) & mask
        g = self.and_(ctx, s, c, width)
        p = s ^ c
        step = 1
        while step < width:
            shift = np.uint64(step)
            both = self.and_(
                ctx,
                jnp.stack([p, p], axis=1),
                jnp.stack([(g << shift) & mask, (p << shift) & mask], axis=1),
                width,
            )
            g, p = g ^ both[:, 0], both[:, 1]
            step *= 2
        return (s ^ c ^ (g << np.uint64(1))) & mask

    @traced_once
    def b2a(self, ctx: Context, bit: Shares) -> Shares:
        one = _u64(1)
        b0, b1, b2 = (self.lift_slot(ctx, lax.bitwise_and(bit, one), j) for j in range(3))
        t = lax.sub(lax.add(b0, b1), lax.shift_left(self.mul(ctx, b0, b1), one))
        return lax.sub(lax.add(t, b2), lax.shift_left(self.mul(ctx, t, b2), one))

    @traced_once
    def lift_slot(self, ctx: Context, a: Shares, j: int) -> Shares:
        """Share x_j of `a` alone, as shares of the same kind (its two holders know it)."""
        a0, a1 = _halves(a)
        zero = jnp.zeros_like(a0)
        return _pair(_if_role(ctx, j, a0, zero), _if_role(ctx, (j - 1) % 3, a1, zero))
