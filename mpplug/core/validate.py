"""Well-formedness of a Graph, regions included: refs, types, placements and region rules.

Every failure is an InvalidProgramError naming the program and the path to the bad op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from mpplug.core.dtypes import DType
from mpplug.core.ops import REGION_KINDS, Block, Op, OpKind, Region, ValueRef, participants
from mpplug.core.parties import PartySet, format_parties
from mpplug.core.types import TensorType, ValueType
from mpplug.errors import InvalidProgramError

if TYPE_CHECKING:
    from mpplug.core.graph import Graph

MAX_WORLD_SIZE = 1024
MAX_REGION_DEPTH = 32
"""How deeply COND and WHILE may nest."""
PREDICATE = TensorType(DType.BOOL, ())

Param = tuple[ValueType, PartySet]


def validate_graph(graph: Graph) -> None:
    n = graph.world_size
    if not 1 <= n <= MAX_WORLD_SIZE:
        raise InvalidProgramError(
            f"program {graph.name!r}, world_size: expected 1..{MAX_WORLD_SIZE}, got {n}"
        )
    _Checker(graph).block(graph, "", None, 0)


class _Checker:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def fail(self, where: str, message: str) -> NoReturn:
        raise InvalidProgramError(f"program {self.graph.name!r}, {where}: {message}")

    def block(self, block: Block, path: str, params: Sequence[Param] | None, depth: int) -> None:
        """Check `block`; `params` are a region's parameter types (None: the top level)."""
        input_indices: set[int] = set()
        for i, op in enumerate(block.ops):
            where = f"{path}op %{i}"
            self.op_header(block, op, i, where)
            if op.kind is OpKind.INPUT:
                if op.inputs or len(op.outs) != 1:
                    self.fail(where, "an input takes no operands and has one output")
                if op.input_index in input_indices:
                    self.fail(where, f"duplicate input index {op.input_index}")
                input_indices.add(op.input_index)
                if params is not None:
                    self.param(op, params, where)
            elif op.kind is OpKind.CALL:
                self.call(block, op, where)
            elif op.kind is OpKind.SHUFFLE:
                self.shuffle(block, op, where)
            else:
                self.region_op(block, op, where, depth)
        expected = set(range(len(input_indices) if params is None else len(params)))
        if input_indices != expected:
            self.fail(
                f"{path}inputs",
                f"expected indices {sorted(expected)}, got {sorted(input_indices)}",
            )
        for j, ref in enumerate(block.outputs):
            self.ref(block, f"{path}output {j}", ref, len(block.ops))

    def ref(self, block: Block, where: str, ref: ValueRef, before: int) -> None:
        if not 0 <= ref.op < before:
            self.fail(where, f"refers to op {ref.op}, expected an earlier op (< {before})")
        if not 0 <= ref.index < len(block.ops[ref.op].outs):
            self.fail(
                where,
                f"refers to output {ref.index} of %{ref.op}, which has "
                f"{len(block.ops[ref.op].outs)}",
            )

    def op_header(self, block: Block, op: Op, i: int, where: str) -> None:
        n = self.graph.world_size
        if op.id != i:
            self.fail(where, f"expected id {i}, got {op.id}")
        if not op.parties or any(not 0 <= p < n for p in op.parties):
            self.fail(
                where, f"expected a non-empty party set within 0..{n - 1}, got {sorted(op.parties)}"
            )
        for j, ref in enumerate(op.inputs):
            self.ref(block, f"{where} input {j}", ref, i)
        if op.kind not in REGION_KINDS and (op.regions or op.out_parties):
            self.fail(where, f"a {op.kind.name.lower()} op has no regions and no out_parties")

    def param(self, op: Op, params: Sequence[Param], where: str) -> None:
        if not 0 <= op.input_index < len(params):
            self.fail(where, f"parameter {op.input_index}, but the region has {len(params)}")
        ttype, holders = params[op.input_index]
        if (op.outs[0], op.parties) != (ttype, holders):
            self.fail(
                where,
                f"parameter {op.input_index} is {op.outs[0]} @{format_parties(op.parties)}, "
                f"its operand is {ttype} @{format_parties(holders)}",
            )

    def call(self, block: Block, op: Op, where: str) -> None:
        functions = self.graph.functions
        if not 0 <= op.function < len(functions):
            self.fail(
                where, f"function index {op.function} out of range ({len(functions)} functions)"
            )
        fn = functions[op.function]
        in_types = tuple(block.value_type(r) for r in op.inputs)
        if in_types != fn.ins_info or op.outs != fn.outs_info:
            self.fail(
                where,
                f"types ({', '.join(map(str, in_types))}) -> "
                f"({', '.join(map(str, op.outs))}) do not match {fn!r}",
            )
        for j, ref in enumerate(op.inputs):
            if not op.parties <= block.holders(ref):
                self.fail(
                    where,
                    f"input {j} is held by {format_parties(block.holders(ref))}, "
                    f"not by every party of {format_parties(op.parties)}",
                )

    def shuffle(self, block: Block, op: Op, where: str) -> None:
        if not op.inputs or len(op.outs) != 1:
            self.fail(where, "a shuffle takes at least one operand and has one output")
        types = {block.value_type(r) for r in op.inputs}
        if types != {op.outs[0]}:
            self.fail(
                where, f"operand types {sorted(map(str, types))} differ from result {op.outs[0]}"
            )
        holders: dict[int, ValueRef] = {}
        for ref in op.inputs:
            for p in block.holders(ref):
                if p in holders:
                    self.fail(where, f"party {p} holds more than one operand")
                holders[p] = ref
        dsts = [d for d, _ in op.routes]
        if len(set(dsts)) != len(dsts) or set(dsts) != op.parties:
            self.fail(
                where,
                f"routes {list(op.routes)} must name each destination of "
                f"{format_parties(op.parties)} exactly once",
            )
        for dst, src in op.routes:
            if src not in holders:
                self.fail(where, f"route {dst}<-{src}: party {src} holds no operand")

    def region_op(self, block: Block, op: Op, where: str, depth: int) -> None:
        if depth >= MAX_REGION_DEPTH:
            self.fail(where, f"regions nest deeper than {MAX_REGION_DEPTH}")
        if len(op.regions) != 2:
            self.fail(where, f"a {op.kind.name.lower()} op has 2 regions, got {len(op.regions)}")
        n = self.graph.world_size
        if len(op.out_parties) != len(op.outs) or any(
            not p or not all(0 <= r < n for r in p) for p in op.out_parties
        ):
            self.fail(where, "expected a non-empty holder set within the world for each output")
        operands = [(block.value_type(r), block.holders(r)) for r in op.inputs]
        results = list(zip(op.outs, op.out_parties, strict=True))
        if op.kind is OpKind.COND:
            if not op.inputs or operands[0][0] != PREDICATE:
                got = operands[0][0] if op.inputs else "no operands"
                self.fail(where, f"expected a {PREDICATE} predicate as input 0, got {got}")
            self.holds_predicate(op, operands[0][1], where, "the predicate")
            for b, region in enumerate(op.regions):
                self.region(region, f"{where} region {b} ", operands[1:], results, depth)
        else:
            if operands[: len(results)] != results:
                self.fail(
                    where, "the loop-carried inputs differ from the outputs in type or holders"
                )
            cond, body = op.regions
            path = f"{where} region 0 "
            self.block(cond, path, operands, depth + 1)
            if len(cond.outputs) != 1 or cond.value_type(cond.outputs[0]) != PREDICATE:
                self.fail(path.strip(), f"expected one {PREDICATE} output")
            self.holds_predicate(op, cond.holders(cond.outputs[0]), where, "the condition")
            self.region(body, f"{where} region 1 ", operands, results, depth)
        taking_part = participants(op.regions[0]) | participants(op.regions[1])
        taking_part |= frozenset().union(*op.out_parties)
        if op.parties != taking_part:
            self.fail(
                where,
                f"parties {format_parties(op.parties)} differ from those taking part in its "
                f"regions and holding its outputs, {format_parties(taking_part)}",
            )

    def region(
        self,
        region: Region,
        path: str,
        params: Sequence[Param],
        results: Sequence[Param],
        depth: int,
    ) -> None:
        self.block(region, path, params, depth + 1)
        got = [(region.value_type(r), region.holders(r)) for r in region.outputs]
        if got != list(results):
            self.fail(path.strip(), "its outputs differ from the op's in number, type or holders")

    def holds_predicate(self, op: Op, holders: PartySet, where: str, what: str) -> None:
        if not op.parties <= holders:
            self.fail(
                where,
                f"{what} is held by {format_parties(holders)}, not by every party taking part "
                f"{format_parties(op.parties)}",
            )
