"""Fixed-point arithmetic on shares: the layer the approximations (`approx`) are written in,
independent of the protocol underneath.

A real v is the ring element round(v * 2^f); a product carries 2f fraction bits and is
truncated back by f bits, one round (see the protocol's `trunc` for its error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpplug.mpc import ring
from mpplug.mpc.protocol import Context, Protocol, Shares


class Fxp:
    """Fixed-point operations for one share program (`ctx.frac_bits` fraction bits)."""

    def __init__(self, protocol: Protocol, ctx: Context) -> None:
        self.protocol = protocol
        self.ctx = ctx
        self.f = ctx.frac_bits

    def const(self, value: Any, shape: Sequence[int]) -> Shares:
        return self.protocol.lift(self.ctx, jnp.broadcast_to(ring.encode(value, self.f), shape))

    def add_const(self, a: Shares, value: Any) -> Shares:
        return a + self.const(value, a.shape[1:])

    def mul(self, a: Shares, b: Shares) -> Shares:
        return self.protocol.mul(self.ctx, a, b, self.f)

    def mul_const(self, a: Shares, value: float) -> Shares:
        """a * value for a public real `value`: local and exact for an integer, else one
        truncation."""
        if float(value).is_integer():
            return a * ring.to_ring(np.int64(value))
        scale = ring.encode(value, self.f)
        return self.protocol.trunc(self.ctx, a * scale, self.f)

    def scale_pow2(self, a: Shares, exponent: int) -> Shares:
        """a * 2^exponent: a local shift up, or a truncation for a negative exponent."""
        if exponent >= 0:
            return a << np.uint64(exponent)
        return self.protocol.trunc(self.ctx, a, -exponent)

    def is_negative(self, a: Shares) -> Shares:
        """The sign bit as arithmetic 0/1 integers."""
        return self.protocol.b2a(self.ctx, self.protocol.msb(self.ctx, a))

    def times_int(self, k: Shares, a: Shares) -> Shares:
        """a times shared integers k (no truncation; one round)."""
        return self.protocol.mul(self.ctx, k, a)
