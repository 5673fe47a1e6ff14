"""`Sealed`: a secret-shared value inside (or returned from) a program, a pytree whose one
leaf is the party value holding every computing party's shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpplug.core.mpobject import MPObject
from mpplug.core.parties import format_parties


@jax.tree_util.register_pytree_node_class
class Sealed:
    """Shares of a tensor of logical `shape` and `dtype` among `parties` (roles in order).

    Floats are fixed point with `frac_bits` fraction bits, rescaled after products by the
    `truncation` protocol; `boolean` marks XOR-shared bits (comparison results); `wide`, an
    integer narrower than 64 bits that is right only modulo 2^width (wrapped when revealed, or
    when a later `mp.mpc.run` reads more than its low bits). Only `mp.mpc.reveal` turns it
    into plaintext.
    """

    __slots__ = (
        "boolean",
        "dtype",
        "frac_bits",
        "parties",
        "protocol",
        "range_check",
        "shape",
        "shares",
        "truncation",
        "wide",
    )

    def __init__(
        self,
        shares: MPObject,
        shape: tuple[int, ...],
        dtype: Any,
        parties: tuple[int, ...],
        *,
        frac_bits: int,
        boolean: bool = False,
        protocol: str = "aby3",
        truncation: str = "precise",
        wide: bool = False,
        range_check: Callable[[], None] | None = None,
    ) -> None:
        self.shares = shares
        self.range_check = range_check
        """Emits the owner's check that the sealed reals fit in fixed point into the program
        being traced (`mp.mpc.seal`), where a computation reads them (see `checked`)."""
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.parties = tuple(parties)
        self.frac_bits = frac_bits
        self.boolean = boolean
        self.protocol = protocol
        self.truncation = truncation
        self.wide = wide

    def _meta(self) -> tuple[Any, ...]:
        return (
            self.shape,
            self.dtype,
            self.parties,
            self.frac_bits,
            self.boolean,
            self.protocol,
            self.truncation,
            self.wide,
        )

    def checked(self) -> Sealed:
        """Itself, once the owner's range check of its reals is in the program being traced:
        `mp.mpc.run` calls it for the sealed values its function reads, `reveal` for every
        one, and flattening for any that leaves `mp.mpc` (a program's output, a control-flow
        operand), so no use of reals out of range escapes its `FixedPointRangeError`."""
        if self.range_check is not None:
            self.range_check()
        return self

    def tree_flatten(self) -> tuple[tuple[MPObject], tuple[Any, ...]]:
        return (self.checked().shares,), self._meta()

    @classmethod
    def tree_unflatten(cls, meta: tuple[Any, ...], children: Any) -> Sealed:
        shape, dtype, parties, frac_bits, boolean, protocol, truncation, wide = meta
        return cls(
            children[0],
            shape,
            dtype,
            parties,
            frac_bits=frac_bits,
            boolean=boolean,
            protocol=protocol,
            truncation=truncation,
            wide=wide,
        )

    @property
    def type_str(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"{_short(self.dtype)}[{dims}]"

    def __repr__(self) -> str:
        fxp = ""
        if np.issubdtype(self.dtype, np.floating):
            fxp = f", fxp{self.frac_bits}"
            if self.truncation != "precise":
                fxp += f", {self.truncation} truncation"
        return (
            f"Sealed({self.type_str} @ {self.protocol}{format_parties(frozenset(self.parties))}"
            f"{fxp})"
        )

    def __bool__(self) -> bool:
        raise TypeError(f"{self!r} has no truth value: reveal it first (mp.mpc.reveal)")


def _short(dtype: np.dtype[Any]) -> str:
    kind = {"f": "f", "i": "i", "u": "u", "b": "bool"}[dtype.kind]
    return kind if kind == "bool" else f"{kind}{dtype.itemsize * 8}"
