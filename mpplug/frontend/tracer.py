"""Tracing `@function` programs into a Graph, and the `Program` that results.

Primitives append ops to the innermost active `GraphBuilder`; nothing runs while tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, update_wrapper
from typing import Any

import jax
import numpy as np
from jax.tree_util import PyTreeDef, keystr

from mpplug.core import PFunction, ValueType
from mpplug.core.graph import Graph, Op, OpKind, Region, ValueRef
from mpplug.core.mpobject import MPObject
from mpplug.core.parties import PartySet, format_parties
from mpplug.errors import InvalidProgramError, TraceError
from mpplug.frontend.fusion import Segment
from mpplug.frontend.jax_export import is_array_like


class TracedValue(MPObject):
    """A party value inside a program being traced: a reference to one op output."""

    __slots__ = ("__weakref__", "builder", "ref")

    def __init__(
        self, builder: GraphBuilder, ref: ValueRef, type: ValueType, parties: PartySet
    ) -> None:
        super().__init__(type, parties)
        self.builder = builder
        self.ref = ref

    def __repr__(self) -> str:
        return f"TracedValue(%{self.ref.op}: {self.type} @ {format_parties(self.parties)})"

    def __bool__(self) -> bool:
        raise TraceError(
            f"{self!r}: a party value has no truth value while tracing; compute the condition "
            f"with mp.run_jax and branch with mp.cond (or jnp.where inside JAX)"
        )

    # Operators: each is an mp.run_jax of the operator at the parties holding both operands.
    __hash__ = MPObject.__hash__  # identity, as before __eq__ became elementwise

    def __add__(self, other: Any) -> Any:
        return _apply(operator.add, "+", self, other)

    def __radd__(self, other: Any) -> Any:
        return _apply(operator.add, "+", other, self)

    def __sub__(self, other: Any) -> Any:
        return _apply(operator.sub, "-", self, other)

    def __rsub__(self, other: Any) -> Any:
        return _apply(operator.sub, "-", other, self)

    def __mul__(self, other: Any) -> Any:
        return _apply(operator.mul, "*", self, other)

    def __rmul__(self, other: Any) -> Any:
        return _apply(operator.mul, "*", other, self)

    def __truediv__(self, other: Any) -> Any:
        return _apply(operator.truediv, "/", self, other)

    def __rtruediv__(self, other: Any) -> Any:
        return _apply(operator.truediv, "/", other, self)

    def __floordiv__(self, other: Any) -> Any:
        return _apply(operator.floordiv, "//", self, other)

    def __rfloordiv__(self, other: Any) -> Any:
        return _apply(operator.floordiv, "//", other, self)

    def __mod__(self, other: Any) -> Any:
        return _apply(operator.mod, "%", self, other)

    def __rmod__(self, other: Any) -> Any:
        return _apply(operator.mod, "%", other, self)

    def __pow__(self, other: Any) -> Any:
        return _apply(operator.pow, "**", self, other)

    def __rpow__(self, other: Any) -> Any:
        return _apply(operator.pow, "**", other, self)

    def __matmul__(self, other: Any) -> Any:
        return _apply(operator.matmul, "@", self, other)

    def __rmatmul__(self, other: Any) -> Any:
        return _apply(operator.matmul, "@", other, self)

    def __and__(self, other: Any) -> Any:
        return _apply(operator.and_, "&", self, other)

    def __rand__(self, other: Any) -> Any:
        return _apply(operator.and_, "&", other, self)

    def __or__(self, other: Any) -> Any:
        return _apply(operator.or_, "|", self, other)

    def __ror__(self, other: Any) -> Any:
        return _apply(operator.or_, "|", other, self)

    def __xor__(self, other: Any) -> Any:
        return _apply(operator.xor, "^", self, other)

    def __rxor__(self, other: Any) -> Any:
        return _apply(operator.xor, "^", other, self)

    def __lt__(self, other: Any) -> Any:
        return _apply(operator.lt, "<", self, other)

    def __le__(self, other: Any) -> Any:
        return _apply(operator.le, "<=", self, other)

    def __gt__(self, other: Any) -> Any:
        return _apply(operator.gt, ">", self, other)

    def __ge__(self, other: Any) -> Any:
        return _apply(operator.ge, ">=", self, other)

    def __eq__(self, other: Any) -> Any:
        return _apply(operator.eq, "==", self, other)

    def __ne__(self, other: Any) -> Any:
        return _apply(operator.ne, "!=", self, other)

    def __neg__(self) -> Any:
        return _apply(operator.neg, "-", self)

    def __pos__(self) -> Any:
        return _apply(operator.pos, "+", self)

    def __abs__(self) -> Any:
        return _apply(operator.abs, "abs", self)

    def __invert__(self) -> Any:
        return _apply(operator.invert, "~", self)

    def __getitem__(self, index: Any) -> Any:
        return _apply(operator.getitem, "[]", self, index)

    __array_ufunc__ = None  # numpy defers: np_array + x is x.__radd__, a run_jax

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"{self!r}: a scalar party value has no len()")
        return self.shape[0]

    def __iter__(self) -> Iterator[Any]:
        if not self.shape:
            raise TypeError(f"{self!r}: a scalar party value is not iterable")
        return (self[i] for i in range(self.shape[0]))

    def __contains__(self, item: Any) -> bool:
        raise TraceError(
            f"{self!r}: `in` needs a truth value while tracing; compute it with "
            f"mp.run_jax(lambda a, v: (a == v).any(), x, v)"
        )


def _apply(fn: Callable[..., Any], symbol: str, *operands: Any) -> Any:
    """`fn(*operands)` as an mp.run_jax where the party-value operands are all held."""
    from mpplug.frontend.primitives import run_jax

    if any(isinstance(o, jax.core.Tracer) for o in operands):
        raise TraceError(
            f"{symbol}: a party value was used inside a JAX function; pass it to mp.run_jax "
            f"as an argument instead (mp.run_jax(lambda a, b: a + b, x, y))"
        )
    text = (
        f"{symbol}{operands[0]!r}"
        if len(operands) == 1
        else f"{operands[0]!r} {symbol} {operands[1]!r}"
    )
    try:
        return run_jax(fn, *operands)
    except TraceError as exc:
        raise TraceError(f"{text}: {exc}") from None


class GraphBuilder:
    """Collects ops and PFunctions for one program being traced, or (with a `parent`) for
    one region of it: a region shares the program's functions, and values of enclosing
    builders used in it become its parameters (`operands` says which value each stands for).
    """

    def __init__(
        self,
        name: str,
        world_size: int,
        party_names: Sequence[str] | None = None,
        platforms: Sequence[str] | None = None,
        *,
        parent: GraphBuilder | None = None,
        dataset_type: Callable[[int, str], ValueType] | None = None,
        fuse: bool = False,
    ) -> None:
        if world_size < 1:
            raise TraceError(f"expected world_size >= 1, got {world_size}")
        self.name = name
        self.world_size = world_size
        self.party_names = list(party_names) if party_names is not None else None
        self.platforms = tuple(platforms) if platforms is not None else None
        self.parent = parent
        self.dataset_type: Callable[[int, str], ValueType] | None = (
            parent.dataset_type if parent else dataset_type
        )
        """Asks the cluster for a party's dataset type (None: tracing without a cluster)."""
        self.functions: list[PFunction] = parent.functions if parent else []
        self._function_index: dict[PFunction, int] = parent._function_index if parent else {}
        self.ops: list[Op] = []
        self.fuse: bool = parent.fuse if parent else fuse
        """Fuse consecutive run_jax calls at one party set into one PFunction (`fusion`)."""
        self.segment: Segment | None = None
        self.operands: list[TracedValue] = []
        self._captured: dict[tuple[int, ValueRef], TracedValue] = {}

    def region(self, name: str) -> GraphBuilder:
        """A builder for a region nested in this one."""
        self.flush()
        return GraphBuilder(
            f"{self.name}/{name}",
            self.world_size,
            self.party_names,
            self.platforms,
            parent=self,
        )

    def param(self, outer: TracedValue) -> TracedValue:
        """A new parameter of this region standing for `outer`, a value of the parent."""
        (inner,) = self.add_op(
            OpKind.INPUT, outer.parties, (), (outer.type,), input_index=len(self.operands)
        )
        self.operands.append(outer)
        return inner

    def bind_operands(self, operands: Sequence[TracedValue], explicit: int) -> None:
        """Make this region's parameters exactly `operands` (values of the parent): its first
        `explicit` parameters as they are, then the values it captured, in their new places,
        and unused parameters for the rest."""
        position = {id(v): explicit + i for i, v in enumerate(operands[explicit:])}
        for op in list(self.ops):
            if op.kind is OpKind.INPUT and op.input_index >= explicit:
                index = position[id(self.operands[op.input_index])]
                self.ops[op.id] = dataclasses.replace(op, input_index=index)
        have = {id(v) for v in self.operands[explicit:]}
        for v in operands[explicit:]:
            if id(v) not in have:
                self.add_op(OpKind.INPUT, v.parties, (), (v.type,), input_index=position[id(v)])
        self.operands = list(operands)

    @property
    def all_parties(self) -> PartySet:
        return frozenset(range(self.world_size))

    def resolve_party(self, party: int | str, where: str) -> int:
        """A rank, given a rank or (where the cluster is known) a party name."""
        if isinstance(party, str):
            if self.party_names is None or party not in self.party_names:
                known = self.party_names or "none (pass a rank)"
                raise TraceError(f"{where}: unknown party name {party!r}; known: {known}")
            return self.party_names.index(party)
        if isinstance(party, bool) or not isinstance(party, int):
            raise TraceError(f"{where}: expected a party rank or name, got {party!r}")
        if not 0 <= party < self.world_size:
            raise TraceError(
                f"{where}: party {party} outside 0..{self.world_size - 1} "
                f"(world_size={self.world_size})"
            )
        return party

    def resolve_parties(
        self, parties: Iterable[int | str] | int | str | None, where: str
    ) -> PartySet:
        if parties is None:
            return self.all_parties
        if isinstance(parties, int | str):
            parties = [parties]
        resolved = frozenset(self.resolve_party(p, where) for p in parties)
        if not resolved:
            raise TraceError(f"{where}: expected at least one party, got none")
        return resolved

    def value(self, x: Any, where: str) -> TracedValue:
        """`x` as a value of this builder: a value of an enclosing one becomes a parameter."""
        if isinstance(x, TracedValue) and x.builder is self:
            return x
        if isinstance(x, TracedValue) and self._encloses(x.builder):
            key = (id(x.builder), x.ref)
            found = self._captured.get(key)
            if found is None:
                assert self.parent is not None
                found = self._captured[key] = self.param(self.parent.value(x, where))
            return found
        if isinstance(x, TracedValue):
            raise TraceError(f"{where}: {x!r} belongs to another program being traced")
        if isinstance(x, MPObject):
            raise TraceError(
                f"{where}: {x!r} is a value outside the program (a handle from put or an "
                f"earlier evaluate, used from the enclosing scope); pass it in as an argument: "
                f"cluster.evaluate(fn, ..., value) and take it as a parameter of fn"
            )
        raise TraceError(f"{where}: expected a party value of this program, got {type(x).__name__}")

    def _encloses(self, builder: GraphBuilder) -> bool:
        outer = self.parent
        while outer is not None:
            if outer is builder:
                return True
            outer = outer.parent
        return False

    def fused(self, parties: PartySet) -> Segment:
        """The open segment of fused calls at `parties` (flushing one at other parties)."""
        if self.segment is not None and self.segment.parties != parties:
            self.flush()
        if self.segment is None:
            self.segment = Segment(len(self.ops), parties)
        return self.segment

    def flush(self) -> None:
        """Append the open segment of fused calls, if any, as its CALL op."""
        segment, self.segment = self.segment, None
        if segment is not None:
            segment.flush(self)

    def add_op(self, kind: OpKind, *args: Any, **kwargs: Any) -> list[TracedValue]:
        """Append an op (after any open segment of fused calls); its output values."""
        self.flush()
        return self.append_op(kind, *args, **kwargs)

    def append_op(
        self,
        kind: OpKind,
        parties: PartySet,
        inputs: Sequence[TracedValue],
        outs: Sequence[ValueType],
        *,
        function: PFunction | None = None,
        routes: Sequence[tuple[int, int]] = (),
        input_index: int = 0,
        regions: Sequence[Region] = (),
        out_parties: Sequence[PartySet] = (),
    ) -> list[TracedValue]:
        op_id = len(self.ops)
        fn_index = 0
        if function is not None:
            fn_index = self._function_index.setdefault(function, len(self.functions))
            if fn_index == len(self.functions):
                self.functions.append(function)
        self.ops.append(
            Op(
                op_id,
                kind,
                parties,
                tuple(v.ref for v in inputs),
                tuple(outs),
                function=fn_index,
                routes=tuple(routes),
                input_index=input_index,
                regions=tuple(regions),
                out_parties=tuple(out_parties),
            )
        )
        holders = list(out_parties) or [parties] * len(outs)
        return [
            TracedValue(self, ValueRef(op_id, i), t, p)
            for i, (t, p) in enumerate(zip(outs, holders, strict=True))
        ]

    def build_region(self, outputs: Sequence[TracedValue]) -> Region:
        self.flush()
        return Region(tuple(self.ops), tuple(v.ref for v in outputs))

    def build(self, outputs: Sequence[TracedValue]) -> Graph:
        self.flush()
        try:
            return Graph(
                self.name,
                self.world_size,
                tuple(self.functions),
                tuple(self.ops),
                tuple(v.ref for v in outputs),
            )
        except InvalidProgramError as exc:
            raise TraceError(f"traced program is malformed: {exc}") from None


def static_key(leaf: Any) -> Any:
    """A cache key for a static (non-party) argument that tells values apart by type as well
    as value (1, 1.0 and True differ, and so do 0.0 and -0.0), or None when the value cannot
    be keyed safely: unhashable, or hashed by identity (a mutable object may change between
    calls). Functions are keyed by identity."""
    kind = type(leaf)
    if isinstance(
        leaf, types.FunctionType | types.BuiltinFunctionType | types.MethodType | np.ufunc
    ):
        return (kind, leaf)
    if kind.__hash__ is None or kind.__hash__ is object.__hash__:
        return None
    try:
        hash(leaf)
    except TypeError:
        return None
    if isinstance(leaf, np.generic):  # by its bytes: np.float32(0.0) and (-0.0) differ
        return (kind, leaf.tobytes())
    if isinstance(leaf, float):
        return (kind, leaf, math.copysign(1.0, leaf))
    if isinstance(leaf, complex):
        parts = (leaf.real, leaf.imag)
        return (kind, *parts, *(math.copysign(1.0, p) for p in parts))
    return (kind, leaf)


_state = threading.local()


def _stack() -> list[GraphBuilder]:
    stack: list[GraphBuilder] | None = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


@contextlib.contextmanager
def tracing(builder: GraphBuilder) -> Iterator[GraphBuilder]:
    """Make `builder` the innermost one while the block runs."""
    stack = _stack()
    stack.append(builder)
    try:
        yield builder
    finally:
        stack.pop()


def current_builder(primitive: str) -> GraphBuilder:
    """The innermost program being traced; a TraceError outside of one."""
    stack = _stack()
    if not stack:
        raise TraceError(
            f"mp.{primitive} can only be used inside an @mp.function that is being traced "
            f"(by mp.compile or mp.evaluate)"
        )
    return stack[-1]


class MPFunction:
    """A Python function marked as a multi-party program (see `function`)."""

    def __init__(self, fn: Callable[..., Any], *, fuse: bool = False) -> None:
        self.fn = fn
        self.fuse = fuse
        update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        current_builder(f"function {self.fn.__name__!r}")
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<mp.function {self.fn.__qualname__}>"


def function(fn: Callable[..., Any] | None = None, *, fuse: bool = False) -> Any:
    """Mark `fn` as a multi-party program; called inside another program it is inlined.

    With `fuse=True` (as `@mp.function(fuse=True)`), consecutive `mp.run_jax` calls at the
    same parties are exported and compiled as one PFunction: a long chain of small ops then
    costs one export and one compile instead of one each.
    """
    if fn is None:
        return lambda f: function(f, fuse=fuse)
    if isinstance(fn, MPFunction) and fn.fuse == fuse:
        return fn
    return MPFunction(fn.fn if isinstance(fn, MPFunction) else fn, fuse=fuse)


@dataclass(frozen=True, slots=True)
class _Output:
    """A placeholder in an output template: party output number `index`."""

    index: int


@dataclass(frozen=True)
class Program:
    """A traced program: its Graph plus, when traced here, how to rebuild the outputs.

    `from_bytes` gives a Program whose outputs come back as a flat list.
    """

    graph: Graph
    out_tree: PyTreeDef | None = None
    out_template: tuple[Any, ...] | None = None

    @classmethod
    def from_bytes(cls, data: bytes) -> Program:
        return cls(Graph.from_bytes(data))

    def to_bytes(self) -> bytes:
        return self.graph.to_bytes()

    @property
    def digest(self) -> str:
        return self.graph.digest

    @property
    def world_size(self) -> int:
        return self.graph.world_size

    def ir(self) -> str:
        return self.graph.ir()

    @cached_property
    def input_types(self) -> list[tuple[ValueType, PartySet]]:
        return [(op.outs[0], op.parties) for op in self.graph.input_ops]

    @cached_property
    def output_types(self) -> list[tuple[ValueType, PartySet]]:
        return [(self.graph.value_type(r), self.graph.holders(r)) for r in self.graph.outputs]

    def unflatten(self, values: Sequence[Any]) -> Any:
        """The traced output pytree with `values` for the party outputs and the host
        constants the function returned; a flat list for a Program from bytes."""
        if self.out_tree is None or self.out_template is None:
            return list(values)
        leaves = [values[t.index] if isinstance(t, _Output) else t for t in self.out_template]
        return jax.tree.unflatten(self.out_tree, leaves)

    def __str__(self) -> str:
        return self.ir()


def trace(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    world_size: int,
    party_names: Sequence[str] | None = None,
    platforms: Sequence[str] | None = None,
    dataset_type: Callable[[int, str], ValueType] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[Program, list[MPObject]]:
    """Trace `fn(*args, **kwargs)`: MPObject leaves of the arguments become program inputs
    (positional ones first, then keywords by name), other leaves are passed through as static
    Python values. Returns the Program and the MPObject arguments in input order.
    `dataset_type(rank, name)` answers `mp.read`'s questions."""
    raw = fn.fn if isinstance(fn, MPFunction) else fn
    name = getattr(raw, "__name__", "program")
    fuse = isinstance(fn, MPFunction) and fn.fuse
    builder = GraphBuilder(
        name, world_size, party_names, platforms, dataset_type=dataset_type, fuse=fuse
    )
    leaves, in_tree = jax.tree.flatten((tuple(args), dict(kwargs or {})))
    inputs: list[MPObject] = []
    traced_leaves: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, MPObject):
            where = f"{name} argument {len(inputs)}"
            parties = builder.resolve_parties(sorted(leaf.parties), where)
            (value,) = builder.add_op(
                OpKind.INPUT, parties, (), (leaf.type,), input_index=len(inputs)
            )
            inputs.append(leaf)
            traced_leaves.append(value)
        else:
            traced_leaves.append(leaf)
    with tracing(builder):
        call_args, call_kwargs = jax.tree.unflatten(in_tree, traced_leaves)
        result = raw(*call_args, **call_kwargs)
        # flattened inside: a pytree that adds ops as it leaves (mp.mpc.Sealed) adds them here
        paths_leaves, out_tree = jax.tree_util.tree_flatten_with_path(result)
    outputs: list[TracedValue] = []
    template: list[Any] = []
    for path, leaf in paths_leaves:
        if isinstance(leaf, MPObject):
            template.append(_Output(len(outputs)))
            outputs.append(builder.value(leaf, f"{name} output{keystr(path)}"))
        elif is_array_like(leaf) and not hasattr(leaf, "__array__"):
            raise TraceError(f"{name} returned a type ({leaf!r}) at output{keystr(path)}")
        else:
            template.append(leaf)  # a host constant, handed back as it is
    return Program(builder.build(outputs), out_tree, tuple(template)), inputs


def compile(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    party_names: Sequence[str] | None = None,
    platforms: Sequence[str] | None = None,
) -> Program:
    """Trace `fn` with placeholder arguments (`MPObject(type, parties)`) into a Program."""
    program, _ = trace(
        fn, args, world_size=world_size, party_names=party_names, platforms=platforms
    )
    return program
