"""`Graph`: the program IR, ops over SSA values placed on party sets, and its wire form.

Op kinds: INPUT (a program argument), CALL (a PFunction via its kernel), SHUFFLE (values move
between parties), and COND and WHILE, which nest regions. Graphs print as indented text and
round-trip through protobuf.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from google.protobuf.message import DecodeError

from mpplug.core import serde
from mpplug.core.ops import (
    REGION_KINDS,
    Block,
    Op,
    OpKind,
    Region,
    ValueRef,
    participants,
    shuffle_sources,
    uses_regions,
    uses_tables,
)
from mpplug.core.parties import format_parties
from mpplug.core.pfunction import PFunction
from mpplug.core.validate import validate_graph
from mpplug.errors import InvalidPFunctionError, InvalidProgramError, UnsupportedDTypeError
from mpplug.protos import values_pb2 as pb

GRAPH_VERSION = 3
"""The newest graph version this code reads and writes: 2 adds COND and WHILE, 3 table types."""
TABLES_VERSION = 3
REGIONS_VERSION = 2
FIRST_VERSION = 1
"""The oldest readable version; a graph is written with the lowest version that expresses it."""


@dataclass(frozen=True)
class Graph(Block):
    """A whole program: functions table, ops in topological order and output refs.

    Guarantees: a Graph built by `from_bytes` is well formed (every ref points back, types
    agree with the PFunctions, parties are within `world_size`, regions recursively so);
    `to_bytes` is canonical.
    """

    name: str
    world_size: int
    functions: tuple[PFunction, ...]
    ops: tuple[Op, ...]
    outputs: tuple[ValueRef, ...]

    def __post_init__(self) -> None:
        validate_graph(self)

    @cached_property
    def version(self) -> int:
        if uses_tables(self):
            return TABLES_VERSION
        return REGIONS_VERSION if uses_regions(self.ops) else FIRST_VERSION

    def to_bytes(self) -> bytes:
        return self._bytes

    @cached_property
    def _bytes(self) -> bytes:
        return _to_proto(self).SerializeToString(deterministic=True)

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self._bytes).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes, canonical: bool = False) -> Graph:
        """Decode and validate; raises InvalidProgramError saying what is wrong and where.

        With `canonical`, the caller vouches that `data` is a graph's own `to_bytes()` (a
        simulator decoding a program it holds): the graph keeps them as its canonical bytes
        instead of writing them again for its digest. Bytes from elsewhere never are."""
        msg = pb.Graph()
        try:
            msg.ParseFromString(bytes(data))
        except (DecodeError, TypeError, RecursionError) as exc:
            raise InvalidProgramError(
                f"program bytes ({len(data)}) do not decode as a Graph: {exc}"
            ) from None
        graph = _from_proto(msg)
        if canonical:
            graph.__dict__["_bytes"] = bytes(data)  # the cached_property's value, given
            for pfunc, written in zip(graph.functions, msg.functions, strict=True):
                # each function's canonical bytes, which `to_bytes` wrote into the graph
                pfunc.__dict__["_bytes"] = written.SerializeToString(deterministic=True)
        return graph

    def ir(self) -> str:
        """Readable text, one op a line, regions indented, in the spirit of a jaxpr."""
        lines = [f"program {self.name}(world_size={self.world_size}) {{"]
        _format_block(self, self, lines, "  ")
        lines.append("}")
        return "\n".join(lines)


def _ref_name(block: Block, ref: ValueRef) -> str:
    return f"%{ref.op}" if len(block.ops[ref.op].outs) == 1 else f"%{ref.op}#{ref.index}"


_REGION_NAMES = {OpKind.COND: ("then", "else"), OpKind.WHILE: ("cond", "body")}


def _format_block(graph: Graph, block: Block, lines: list[str], indent: str) -> None:
    for op in block.ops:
        lines.append(indent + _format_op(graph, block, op))
        for name, region in zip(_REGION_NAMES.get(op.kind, ()), op.regions, strict=True):
            lines.append(f"{indent}  {name} {{")
            _format_block(graph, region, lines, indent + "    ")
            lines.append(f"{indent}  }}")
    lines.append(indent + "return " + ", ".join(_ref_name(block, r) for r in block.outputs))


def _format_op(graph: Graph, block: Block, op: Op) -> str:
    results = ", ".join(_ref_name(block, ValueRef(op.id, i)) for i in range(len(op.outs))) or "()"
    args = ", ".join(_ref_name(block, r) for r in op.inputs)
    types = ", ".join(map(str, op.outs))
    if op.out_parties:
        types = ", ".join(
            f"{t} @{format_parties(p)}" for t, p in zip(op.outs, op.out_parties, strict=True)
        )
    where = format_parties(op.parties)
    if op.kind is OpKind.INPUT:
        body = f"input[{op.input_index}]"
    elif op.kind is OpKind.CALL:
        fn = graph.functions[op.function]
        body = f"call {fn.fn_type}:{fn.fn_name}({args})"
    elif op.kind is OpKind.SHUFFLE:
        routes = ",".join(f"{dst}<-{src}" for dst, src in op.routes)
        body = f"shuffle[{routes}]({args})"
    else:
        body = f"{op.kind.name.lower()}({args})"
    return f"{results} = {body} @{where} : {types}"


def _to_proto(graph: Graph) -> pb.Graph:
    return pb.Graph(
        version=graph.version,
        name=graph.name,
        world_size=graph.world_size,
        # each function as its canonical bytes, written once (the same bytes, 10x faster)
        functions=[pb.PFunction.FromString(f.to_bytes()) for f in graph.functions],
        ops=[_op_to_proto(op) for op in graph.ops],
        outputs=[pb.ValueRef(op=r.op, index=r.index) for r in graph.outputs],
    )


def _op_to_proto(op: Op) -> pb.Op:
    return pb.Op(
        id=op.id,
        kind=op.kind.value,
        parties=sorted(op.parties),
        inputs=[pb.ValueRef(op=r.op, index=r.index) for r in op.inputs],
        outs=[serde.value_type_to_proto(t) for t in op.outs],
        function=op.function,
        routes=[pb.Route(dst=d, src=s) for d, s in op.routes],
        input_index=op.input_index,
        regions=[
            pb.Region(
                ops=[_op_to_proto(o) for o in region.ops],
                outputs=[pb.ValueRef(op=r.op, index=r.index) for r in region.outputs],
            )
            for region in op.regions
        ],
        out_parties=[pb.PartyList(parties=sorted(p)) for p in op.out_parties],
    )


def _from_proto(msg: pb.Graph) -> Graph:
    if not FIRST_VERSION <= msg.version <= GRAPH_VERSION:
        newer = (
            ": the program was written by a newer mpplug than this one; upgrade it"
            if msg.version > GRAPH_VERSION
            else ""
        )
        raise InvalidProgramError(
            f"expected graph version {FIRST_VERSION}..{GRAPH_VERSION}, got {msg.version}{newer}"
        )
    try:
        functions = tuple(
            serde.pfunction_from_proto(f, f"functions[{i}]") for i, f in enumerate(msg.functions)
        )
        ops = _ops_from_proto(msg.ops, "ops", msg.version)
    except (InvalidPFunctionError, UnsupportedDTypeError, ValueError) as exc:
        if isinstance(exc, InvalidProgramError):
            raise
        raise InvalidProgramError(str(exc)) from None
    graph = Graph(
        msg.name,
        msg.world_size,
        functions,
        ops,
        tuple(ValueRef(r.op, r.index) for r in msg.outputs),
    )
    if graph.version != msg.version:
        raise InvalidProgramError(
            f"program {graph.name!r}: graph version {msg.version} given, but its ops need "
            f"exactly version {graph.version}"
        )
    return graph


def _ops_from_proto(msgs: Sequence[pb.Op], where: str, version: int) -> tuple[Op, ...]:
    ops = []
    for i, op in enumerate(msgs):
        at = f"{where}[{i}]"
        if op.kind not in (k.value for k in OpKind):
            raise InvalidProgramError(f"{at}: unknown op kind {op.kind}")
        kind = OpKind(op.kind)
        if kind in REGION_KINDS and version < REGIONS_VERSION:
            raise InvalidProgramError(
                f"{at}: a {kind.name} op needs graph version {REGIONS_VERSION}, got {version}"
            )
        ops.append(
            Op(
                id=op.id,
                kind=kind,
                parties=frozenset(op.parties),
                inputs=tuple(ValueRef(r.op, r.index) for r in op.inputs),
                outs=tuple(
                    serde.value_type_from_proto(t, f"{at}.outs[{j}]") for j, t in enumerate(op.outs)
                ),
                function=op.function,
                routes=tuple((r.dst, r.src) for r in op.routes),
                input_index=op.input_index,
                regions=tuple(
                    Region(
                        _ops_from_proto(r.ops, f"{at}.regions[{j}].ops", version),
                        tuple(ValueRef(o.op, o.index) for o in r.outputs),
                    )
                    for j, r in enumerate(op.regions)
                ),
                out_parties=tuple(frozenset(p.parties) for p in op.out_parties),
            )
        )
    return tuple(ops)


__all__ = [
    "GRAPH_VERSION",
    "Graph",
    "Op",
    "OpKind",
    "Region",
    "ValueRef",
    "participants",
    "shuffle_sources",
]
