"""The protocol interface: what a secret-sharing scheme provides to `mp.mpc`, at the
program level (setup, seal, reveal) and inside a share program (local ops and exchanges).

A share program is one JAX function run by every computing party (SPMD over roles); its
only communication is `rounds.exchange`. `aby3` is the implementation shipped; another
scheme (for example two parties and a dealer) is one more module implementing this class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpplug.frontend.tracer import TracedValue
from mpplug.mpc import ring

Shares = jnp.ndarray
"""One party's local shares of a tensor, as the protocol lays them out (ring dtype)."""


@dataclass
class Context:
    """What a share program knows while it is traced: this party's role, its PRF keys,
    the fixed-point precision, the truncation protocol (`TRUNCATIONS`) and a counter that
    gives every random stream its own name (`next_stream(count)` reserves `count` numbers in a
    row and returns the first)."""

    role: jnp.ndarray
    keys: jnp.ndarray
    frac_bits: int
    next_stream: Callable[..., int]
    truncation: str = "precise"
    _is_role: dict[int, jnp.ndarray] = field(default_factory=dict, repr=False)

    def is_role(self, role: int) -> jnp.ndarray:
        """Whether this party has `role`, a bool[] computed once per share program (a
        protocol asks it at every step that differs by role)."""
        found = self._is_role.get(role)
        if found is None:
            found = self._is_role[role] = lax.eq(self.role, np.int32(role))
        return found


TRUNCATIONS = ("precise", "probabilistic")
"""How fixed-point results are rescaled: `precise` (off by at most one unit in the last place
for every value in range; the default) or `probabilistic` (cheaper, and wrong by about
2^(64-bits) with a probability that grows with the value; see docs/mpc.md)."""


class Protocol(ABC):
    """A secret-sharing protocol over Z_2^64 among `n_parties` computing parties."""

    name: str
    n_parties: int

    # -- program level ---------------------------------------------------------------------

    @abstractmethod
    def setup(self, parties: Sequence[int]) -> list[TracedValue]:
        """Once per program: the per-party context values (role, fresh PRF keys)."""

    @abstractmethod
    def share(
        self, x: TracedValue, owner: int, parties: Sequence[int], encode: ring.Encoding
    ) -> TracedValue:
        """Shares of `encode(x)` (a ring array) held by `owner`, among `parties`."""

    @abstractmethod
    def open(
        self,
        shares: TracedValue,
        boolean: bool,
        parties: Sequence[int],
        to: Sequence[int],
        decode: ring.Decoding,
    ) -> TracedValue:
        """The plaintext `decode(value)` at the parties `to`, and nowhere else."""

    # -- inside a share program --------------------------------------------------------------

    @abstractmethod
    def shares_aval(self, shape: Sequence[int]) -> jax.ShapeDtypeStruct:
        """The local shares' type for a tensor of `shape`."""

    @abstractmethod
    def lift(self, ctx: Context, ring: jnp.ndarray) -> Shares:
        """A public ring value as shares (no communication)."""

    @abstractmethod
    def local(self, fn: Callable[..., jnp.ndarray], *shares: Shares) -> Shares:
        """Apply a function that is linear over the ring to each share."""

    @abstractmethod
    def mul(self, ctx: Context, a: Shares, b: Shares, bits: int = 0) -> Shares:
        """Elementwise product, arithmetically shifted right by `bits` when `bits` > 0 (a
        fixed-point product: the truncation is fused with the product where it pays)."""

    @abstractmethod
    def dot_general(
        self, ctx: Context, a: Shares, b: Shares, dimension_numbers: Any, bits: int = 0
    ) -> Shares:
        """`lax.dot_general` of shares, shifted right by `bits` as `mul`."""

    @abstractmethod
    def bilinear(
        self,
        ctx: Context,
        a: Shares,
        b: Shares,
        product: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray],
        bits: int = 0,
        tag: str = "bilinear",
    ) -> Shares:
        """Any ring-bilinear `product` of shares (a convolution), shifted right by `bits`."""

    @abstractmethod
    def trunc(self, ctx: Context, a: Shares, bits: int) -> Shares:
        """Arithmetic right shift by `bits` (fixed-point rescaling), by `ctx.truncation`."""

    @abstractmethod
    def xor_public(self, ctx: Context, a: Shares, mask: Any) -> Shares:
        """Boolean shares XOR a public word."""

    @abstractmethod
    def and_(self, ctx: Context, a: Shares, b: Shares, bits: int = 64) -> Shares:
        """Bitwise AND of boolean shares whose values fit in `bits` bits (one round)."""

    @abstractmethod
    def msb(self, ctx: Context, a: Shares, width: int = 64, carry: Shares | None = None) -> Shares:
        """Boolean shares (bit 0) of bit `width` - 1 (a power of two) of a + `carry` (boolean
        shares of a bit, or None) modulo 2^width: the sign of a width-bit value."""

    @abstractmethod
    def shuffle(self, ctx: Context, a: Shares, blocks: int) -> Shares:
        """Fresh shares of `a` with its last axis permuted by a uniformly random permutation
        that no party learns, each of `blocks` equal runs of that axis within itself."""

    @abstractmethod
    def open_bits(self, ctx: Context, bits: Shares) -> jnp.ndarray:
        """Boolean shares (bit 0) opened to every computing party: a public bool array."""

    @abstractmethod
    def low_bits(self, ctx: Context, a: Shares, width: int) -> Shares:
        """Boolean shares of arithmetic shares' value mod 2^width (bits 0..width-1)."""

    @abstractmethod
    def b2a(self, ctx: Context, bit: Shares) -> Shares:
        """Arithmetic shares of a shared bit (bit 0 of boolean shares)."""
