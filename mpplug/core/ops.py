"""IR nodes: `Op`, the `Region` a COND or WHILE op nests, and the `ValueRef` between them.

A `Block` (the whole graph or one region) is ops in topological order plus output refs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from mpplug.core.parties import PartySet
from mpplug.core.types import TableType, ValueType
from mpplug.protos import values_pb2 as pb


class OpKind(enum.Enum):
    INPUT = pb.Op.INPUT
    CALL = pb.Op.CALL
    SHUFFLE = pb.Op.SHUFFLE
    COND = pb.Op.COND
    WHILE = pb.Op.WHILE


REGION_KINDS = frozenset({OpKind.COND, OpKind.WHILE})


class ValueRef(NamedTuple):
    """Output `index` of op `op` (of the same block); a tuple, so it hashes fast."""

    op: int
    index: int = 0  # type: ignore[assignment]  # shadows tuple.index, which nothing uses


@dataclass(frozen=True)
class Op:
    """One IR node. `parties` hold its outputs: CALL runs there, SHUFFLE delivers there.

    COND and WHILE hold `regions`; their `parties` are every party taking part, and
    `out_parties` says who holds each output.
    """

    id: int
    kind: OpKind
    parties: PartySet
    inputs: tuple[ValueRef, ...]
    outs: tuple[ValueType, ...]
    function: int = 0
    routes: tuple[tuple[int, int], ...] = ()
    input_index: int = 0
    regions: tuple[Region, ...] = ()
    out_parties: tuple[PartySet, ...] = ()

    @cached_property
    def label(self) -> str:
        return f"%{self.id} ({self.kind.name.lower()})"

    def holders(self, index: int) -> PartySet:
        """The parties holding output `index`."""
        return self.out_parties[index] if self.out_parties else self.parties


class Block:
    """Ops in topological order (an op's id is its position) and the refs it returns."""

    ops: tuple[Op, ...]
    outputs: tuple[ValueRef, ...]

    def value_type(self, ref: ValueRef) -> ValueType:
        return self.ops[ref.op].outs[ref.index]

    def holders(self, ref: ValueRef) -> PartySet:
        return self.ops[ref.op].holders(ref.index)

    @property
    def input_ops(self) -> list[Op]:
        """The INPUT ops (program arguments, or a region's parameters) by position."""
        return sorted(
            (op for op in self.ops if op.kind is OpKind.INPUT), key=lambda op: op.input_index
        )


@dataclass(frozen=True)
class Region(Block):
    """A sub-program nested in a COND or WHILE op; closed: refs point at its own ops, and its
    INPUT ops are its parameters, one per operand of the op that holds it."""

    ops: tuple[Op, ...]
    outputs: tuple[ValueRef, ...]


def shuffle_sources(block: Block, op: Op) -> dict[int, ValueRef]:
    """For a SHUFFLE op: which operand each source party sends."""
    found: dict[int, ValueRef] = {}
    for ref in op.inputs:
        for p in block.holders(ref):
            found[p] = ref
    return found


def participants(block: Block) -> PartySet:
    """Every party with work in `block`: running a call, sending or receiving a value, or
    taking part in a nested COND or WHILE (parameters alone are no work)."""
    found: set[int] = set()
    for op in block.ops:
        if op.kind is OpKind.SHUFFLE:
            found.update(op.parties, (src for _, src in op.routes))
        elif op.kind is not OpKind.INPUT:
            found.update(op.parties)
    return frozenset(found)


def uses_regions(ops: tuple[Op, ...]) -> bool:
    return any(op.kind in REGION_KINDS for op in ops)


def uses_tables(block: Block) -> bool:
    """Whether any value of `block`, or of a region in it, is a table."""
    return any(isinstance(t, TableType) for op in block.ops for t in op.outs) or any(
        uses_tables(r) for op in block.ops for r in op.regions
    )
