"""`Graph`: the program IR, a flat list of ops over SSA values placed on party sets.

Three op kinds: INPUT (a program argument), CALL (a PFunction via its kernel) and SHUFFLE
(values move between parties). Graphs print as readable text and round-trip through protobuf.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NoReturn

from google.protobuf.message import DecodeError

from mpplug.core import serde
from mpplug.core.parties import PartySet, format_parties
from mpplug.core.pfunction import PFunction
from mpplug.core.types import TensorType
from mpplug.errors import InvalidPFunctionError, InvalidProgramError, UnsupportedDTypeError
from mpplug.protos import values_pb2 as pb

GRAPH_VERSION = 1
MAX_WORLD_SIZE = 1024


class OpKind(enum.Enum):
    INPUT = pb.Op.INPUT
    CALL = pb.Op.CALL
    SHUFFLE = pb.Op.SHUFFLE


@dataclass(frozen=True, slots=True)
class ValueRef:
    """Output `index` of op `op`."""

    op: int
    index: int = 0


@dataclass(frozen=True)
class Op:
    """One IR node. `parties` hold its outputs; CALL runs there, SHUFFLE delivers there."""

    id: int
    kind: OpKind
    parties: PartySet
    inputs: tuple[ValueRef, ...]
    outs: tuple[TensorType, ...]
    function: int = 0
    routes: tuple[tuple[int, int], ...] = ()
    input_index: int = 0

    @cached_property
    def label(self) -> str:
        return f"%{self.id} ({self.kind.name.lower()})"


@dataclass(frozen=True)
class Graph:
    """A whole program: functions table, ops in topological order and output refs.

    Guarantees: a Graph built by `from_bytes` is well formed (every ref points back, types
    agree with the PFunctions, parties are within `world_size`); `to_bytes` is canonical.
    """

    name: str
    world_size: int
    functions: tuple[PFunction, ...]
    ops: tuple[Op, ...]
    outputs: tuple[ValueRef, ...]

    def __post_init__(self) -> None:
        _validate(self)

    def value_type(self, ref: ValueRef) -> TensorType:
        return self.ops[ref.op].outs[ref.index]

    def holders(self, ref: ValueRef) -> PartySet:
        return self.ops[ref.op].parties

    @property
    def input_ops(self) -> list[Op]:
        return sorted(
            (op for op in self.ops if op.kind is OpKind.INPUT), key=lambda op: op.input_index
        )

    def to_bytes(self) -> bytes:
        return self._bytes

    @cached_property
    def _bytes(self) -> bytes:
        return _to_proto(self).SerializeToString(deterministic=True)

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self._bytes).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes) -> Graph:
        """Decode and validate; raises InvalidProgramError saying what is wrong and where."""
        msg = pb.Graph()
        try:
            msg.ParseFromString(bytes(data))
        except (DecodeError, TypeError) as exc:
            raise InvalidProgramError(
                f"program bytes ({len(data)}) do not decode as a Graph: {exc}"
            ) from None
        return _from_proto(msg)

    def ir(self) -> str:
        """Readable text, one op a line, in the spirit of a jaxpr."""
        lines = [f"program {self.name}(world_size={self.world_size}) {{"]
        for op in self.ops:
            lines.append("  " + _format_op(self, op))
        lines.append("  return " + ", ".join(_ref_name(self, r) for r in self.outputs))
        lines.append("}")
        return "\n".join(lines)


def _ref_name(graph: Graph, ref: ValueRef) -> str:
    return f"%{ref.op}" if len(graph.ops[ref.op].outs) == 1 else f"%{ref.op}#{ref.index}"


def _format_op(graph: Graph, op: Op) -> str:
    results = ", ".join(_ref_name(graph, ValueRef(op.id, i)) for i in range(len(op.outs))) or "()"
    args = ", ".join(_ref_name(graph, r) for r in op.inputs)
    types = ", ".join(map(str, op.outs))
    where = format_parties(op.parties)
    if op.kind is OpKind.INPUT:
        body = f"input[{op.input_index}]"
    elif op.kind is OpKind.CALL:
        fn = graph.functions[op.function]
        body = f"call {fn.fn_type}:{fn.fn_name}({args})"
    else:
        routes = ",".join(f"{dst}<-{src}" for dst, src in op.routes)
        body = f"shuffle[{routes}]({args})"
    return f"{results} = {body} @{where} : {types}"


def _to_proto(graph: Graph) -> pb.Graph:
    return pb.Graph(
        version=GRAPH_VERSION,
        name=graph.name,
        world_size=graph.world_size,
        functions=[serde.pfunction_to_proto(f) for f in graph.functions],
        ops=[
            pb.Op(
                id=op.id,
                kind=op.kind.value,
                parties=sorted(op.parties),
                inputs=[pb.ValueRef(op=r.op, index=r.index) for r in op.inputs],
                outs=[serde.tensor_type_to_proto(t) for t in op.outs],
                function=op.function,
                routes=[pb.Route(dst=d, src=s) for d, s in op.routes],
                input_index=op.input_index,
            )
            for op in graph.ops
        ],
        outputs=[pb.ValueRef(op=r.op, index=r.index) for r in graph.outputs],
    )


def _from_proto(msg: pb.Graph) -> Graph:
    if msg.version != GRAPH_VERSION:
        raise InvalidProgramError(f"expected graph version {GRAPH_VERSION}, got {msg.version}")
    try:
        functions = tuple(
            serde.pfunction_from_proto(f, f"functions[{i}]") for i, f in enumerate(msg.functions)
        )
        ops = []
        for i, op in enumerate(msg.ops):
            if op.kind not in (k.value for k in OpKind):
                raise InvalidProgramError(f"ops[{i}]: unknown op kind {op.kind}")
            ops.append(
                Op(
                    id=op.id,
                    kind=OpKind(op.kind),
                    parties=frozenset(op.parties),
                    inputs=tuple(ValueRef(r.op, r.index) for r in op.inputs),
                    outs=tuple(
                        serde.tensor_type_from_proto(t, f"ops[{i}].outs[{j}]")
                        for j, t in enumerate(op.outs)
                    ),
                    function=op.function,
                    routes=tuple((r.dst, r.src) for r in op.routes),
                    input_index=op.input_index,
                )
            )
    except (InvalidPFunctionError, UnsupportedDTypeError, ValueError) as exc:
        if isinstance(exc, InvalidProgramError):
            raise
        raise InvalidProgramError(str(exc)) from None
    return Graph(
        msg.name,
        msg.world_size,
        functions,
        tuple(ops),
        tuple(ValueRef(r.op, r.index) for r in msg.outputs),
    )


def _validate(graph: Graph) -> None:
    def fail(where: str, message: str) -> NoReturn:
        raise InvalidProgramError(f"program {graph.name!r}, {where}: {message}")

    n = graph.world_size
    if not 1 <= n <= MAX_WORLD_SIZE:
        fail("world_size", f"expected 1..{MAX_WORLD_SIZE}, got {n}")
    input_indices: set[int] = set()

    def check_ref(where: str, ref: ValueRef, before: int) -> None:
        if not 0 <= ref.op < before:
            fail(where, f"refers to op {ref.op}, expected an earlier op (< {before})")
        if not 0 <= ref.index < len(graph.ops[ref.op].outs):
            fail(
                where,
                f"refers to output {ref.index} of %{ref.op}, which has "
                f"{len(graph.ops[ref.op].outs)}",
            )

    for i, op in enumerate(graph.ops):
        where = f"op %{i}"
        if op.id != i:
            fail(where, f"expected id {i}, got {op.id}")
        if not op.parties or any(not 0 <= p < n for p in op.parties):
            fail(
                where, f"expected a non-empty party set within 0..{n - 1}, got {sorted(op.parties)}"
            )
        for j, ref in enumerate(op.inputs):
            check_ref(f"{where} input {j}", ref, i)
        if op.kind is OpKind.INPUT:
            if op.inputs or len(op.outs) != 1:
                fail(where, "an input takes no operands and has one output")
            if op.input_index in input_indices:
                fail(where, f"duplicate input index {op.input_index}")
            input_indices.add(op.input_index)
        elif op.kind is OpKind.CALL:
            if not 0 <= op.function < len(graph.functions):
                fail(
                    where,
                    f"function index {op.function} out of range ({len(graph.functions)} functions)",
                )
            fn = graph.functions[op.function]
            in_types = tuple(graph.value_type(r) for r in op.inputs)
            if in_types != fn.ins_info or op.outs != fn.outs_info:
                fail(
                    where,
                    f"types ({', '.join(map(str, in_types))}) -> "
                    f"({', '.join(map(str, op.outs))}) do not match {fn!r}",
                )
            for j, ref in enumerate(op.inputs):
                if not op.parties <= graph.holders(ref):
                    fail(
                        where,
                        f"input {j} is held by {format_parties(graph.holders(ref))}, "
                        f"not by every party of {format_parties(op.parties)}",
                    )
        else:
            _validate_shuffle(graph, op, fail)
    if input_indices != set(range(len(input_indices))):
        fail("inputs", f"expected indices 0..{len(input_indices) - 1}, got {sorted(input_indices)}")
    for j, ref in enumerate(graph.outputs):
        check_ref(f"output {j}", ref, len(graph.ops))


def _validate_shuffle(graph: Graph, op: Op, fail: Callable[[str, str], NoReturn]) -> None:
    def bad(message: str) -> NoReturn:
        fail(f"op %{op.id}", message)

    if not op.inputs or len(op.outs) != 1:
        bad("a shuffle takes at least one operand and has one output")
    types = {graph.value_type(r) for r in op.inputs}
    if types != {op.outs[0]}:
        bad(f"operand types {sorted(map(str, types))} differ from result {op.outs[0]}")
    holders: dict[int, ValueRef] = {}
    for ref in op.inputs:
        for p in graph.holders(ref):
            if p in holders:
                bad(f"party {p} holds more than one operand")
            holders[p] = ref
    dsts = [d for d, _ in op.routes]
    if len(set(dsts)) != len(dsts) or set(dsts) != op.parties:
        bad(
            f"routes {list(op.routes)} must name each destination of "
            f"{format_parties(op.parties)} exactly once"
        )
    for dst, src in op.routes:
        if src not in holders:
            bad(f"route {dst}<-{src}: party {src} holds no operand")


def shuffle_sources(graph: Graph, op: Op) -> dict[int, ValueRef]:
    """For a SHUFFLE op: which operand each source party sends."""
    found: dict[int, ValueRef] = {}
    for ref in op.inputs:
        for p in graph.holders(ref):
            found[p] = ref
    return found
