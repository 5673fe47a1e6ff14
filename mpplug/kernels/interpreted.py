"""The first tier of `jax.exec`: a StableHLO module run op by op with numpy, compiling nothing,
so a program's first run starts at once and XLA compiles its functions for the runs after.

`plan(module)` turns a module into a `Plan`, or raises `Unsupported`, and the caller compiles
the module instead. A plan gives the bits XLA's executable gives, never close-by ones:

- integer ops wrap around, division by zero and shifts past the width give what XLA gives;
- conversions from floats to integers saturate, and NaN gives 0;
- float ops are only the correctly rounded IEEE ones: add, subtract, multiply, divide and sqrt;
- no float value it computes with is subnormal: XLA's CPU code reads and writes subnormals as
  zeros, but its compiler folds constants keeping them, so a call that meets one (an argument,
  or a result of arithmetic) raises `NotExact` and the caller compiles; a module with a
  subnormal constant is compiled. Adding or subtracting a constant zero is no op, as XLA's
  simplifier makes it (it keeps -0.0, which IEEE's -0.0 + 0.0 does not). Float arithmetic that
  gives a NaN raises `NotExact` too: of two NaN operands, XLA's code and numpy's keep
  different ones;
- a float reduction or product runs only when it is exact in any order: integral values whose
  sums stay within the mantissa. Otherwise the call raises `NotExact`, and the caller compiles.

Transcendental functions (exp, log, tanh, ...) are not planned, because XLA's approximations
differ from numpy's in the last bits. The parties of a program must compute the same public
values, whichever tier each one runs.
"""

from __future__ import annotations

import math
import string
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend import mlir
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

Array = np.ndarray
Fn = Callable[..., Any]

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(dtype)
    for name, dtype in {
        "i1": np.bool_,
        "i8": np.int8,
        "i16": np.int16,
        "i32": np.int32,
        "i64": np.int64,
        "ui8": np.uint8,
        "ui16": np.uint16,
        "ui32": np.uint32,
        "ui64": np.uint64,
        "f32": np.float32,
        "f64": np.float64,
    }.items()
}
"""The element types a plan computes in; a module with any other (f16, bf16, complex) is
compiled."""

VALUE_LIMIT_BYTES = 64 << 20
"""A module with an op result bigger than this is compiled: numpy would hold each such value
in memory where XLA fuses the ops and holds none (a big dataset's first run)."""

UNFOLD_LIMIT_BYTES = 64 << 20
"""A convolution whose input windows, side by side, take at most this runs as one product;
a bigger one sums a product per window offset."""

CHECK_CHUNK = 1 << 20
"""Elements read at a time when checking that a float sum is exact."""

STEP_BYTES = 400
"""What one step of a plan holds in Python objects (the step, its numpy call's closure and
cells, its slot tuples): 330 bytes over the MLP step's 25,039 steps, 410 with a scalar
constant each. A plan's weight counts it, so a budget of plans bounds their memory."""

KEPT_CONSTANT_BYTES = 64 << 10
"""Constants at most this big (a broadcast one counts its one element) are read once per MLIR
context; a bigger one is read for each plan, which holds it and frees it with the plan."""

BOUND_DEPTH = 32
"""Ops a bound is followed back through (see `_Block.bound`); past them, a value has its
type's range (none for floats), so a product reading it is checked at each call."""

BROADCAST_COPY_BYTES = 64 << 10
"""A broadcast result at most this big is a new array (about 1 us against 3.7 us for numpy's
broadcast view); a bigger one is a view, which holds no memory of its own."""

HOT_CALLS = 8
"""Calls after which a plan writes itself as one Python function (see `_written`)."""

FOLD_LIMIT_BYTES = 1 << 20
"""Ops whose operands are all constants run while planning when the result is at most this
big (or is a broadcast view, which holds no memory of its own)."""


class Unsupported(Exception):
    """The module uses something a plan does not run: compile it instead."""


class NotExact(Exception):
    """A float reduction or product whose result would depend on the order of its sums, or a
    float XLA's code and numpy's give other bits for: a subnormal, or a NaN from arithmetic."""


@dataclass(slots=True)
class Step:
    fn: Fn
    ins: tuple[int, ...]
    out: int | tuple[int, ...]
    frees: tuple[int, ...]
    """Slots no later step reads: dropped after this one, so big intermediates do not pile up."""


@dataclass(frozen=True)
class Plan:
    """One function of a module as numpy calls on slots: `plan(*arrays)` returns its results.
    A plan called `HOT_CALLS` times (a loop's body) writes itself as one Python function."""

    n_slots: int
    constants: tuple[tuple[int, Any], ...]
    params: tuple[int, ...]
    steps: tuple[Step, ...]
    results: tuple[int, ...]
    weight: int
    """Bytes of the constants the plan holds, plus `STEP_BYTES` a step."""
    _hot: list[Any] = field(default_factory=lambda: [0, None], compare=False, repr=False)
    """Calls so far, and the function the plan wrote once hot."""

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        hot = self._hot
        if hot[1] is not None:
            return hot[1](*args)
        hot[0] += 1
        if hot[0] >= HOT_CALLS:
            hot[1] = _written(self)
        env: list[Any] = [None] * self.n_slots
        for slot, value in self.constants:
            env[slot] = value
        for slot, arg in zip(self.params, args, strict=True):
            env[slot] = arg
        with np.errstate(all="ignore"):
            for step in self.steps:
                value = step.fn(*[env[i] for i in step.ins])
                out = step.out
                if isinstance(out, int):
                    env[out] = value
                else:
                    for slot, item in zip(out, value, strict=True):
                        env[slot] = item
                for slot in step.frees:
                    env[slot] = None
        return tuple(env[i] for i in self.results)


def _written(plan: Plan) -> Callable[..., tuple[Any, ...]]:
    """The plan as the Python function its steps make, each slot a local variable (a call
    then costs its numpy calls alone: a loop's body runs its plan thousands of times)."""
    names: dict[str, Any] = {"errstate": np.errstate}
    held = {}
    for slot, value in plan.constants:
        held[slot] = f"k{slot}"
        names[f"k{slot}"] = value

    def read(slot: int) -> str:
        return held.get(slot, f"s{slot}")

    params = ", ".join(f"s{slot}" for slot in plan.params)
    lines = [f"def plan({params}):", "    with errstate(all='ignore'):"]
    for index, step in enumerate(plan.steps):
        names[f"f{index}"] = step.fn
        outs = (
            f"s{step.out} = " if isinstance(step.out, int) else "".join(f"s{o}, " for o in step.out)
        )
        if outs.endswith(", "):
            outs += "= "
        lines.append(f"        {outs}f{index}({', '.join(map(read, step.ins))})")
        dropped = [f"s{slot}" for slot in step.frees if slot not in held]
        if dropped:
            lines.append(f"        del {', '.join(dropped)}")
    if not plan.steps:
        lines.append("        pass")
    lines.append(f"    return ({''.join(read(slot) + ', ' for slot in plan.results)})")
    exec(compile("\n".join(lines), "<mpplug plan>", "exec"), names)  # slots and indices only
    return names["plan"]


CONTEXT_USES = 256
"""Modules a thread parses in one MLIR context before it starts a new one: loading the
dialects takes more than parsing a round, and a context keeps what it parsed until dropped."""

_contexts = threading.local()


def _context() -> ir.Context:
    found = getattr(_contexts, "context", None)
    if found is None or _contexts.uses >= CONTEXT_USES:
        found = _contexts.context = ir.Context()
        _contexts.uses = 0
    _contexts.uses += 1
    return found


def plan_serialized(module: bytes) -> Plan:
    """`plan` of a module serialized as `jax.export` stores it (a portable artifact)."""
    with _context() as context:
        return plan(mlir.deserialize_portable_artifact(module, context))


def plan(module: ir.Module) -> Plan:
    """The module's `main` as a plan whose call takes and returns numpy arrays (raises
    `Unsupported`)."""
    if getattr(_contexts, "typed", None) is not module.context:  # `_tensor`'s types: its own
        _contexts.typed, _contexts.types = module.context, {}
        _contexts.checked, _contexts.ints, _contexts.constants = set(), {}, {}
    _contexts.planning = (None, None)
    funcs = {}
    for op in module.body.operations:
        if op.operation.name != "func.func":
            raise Unsupported(f"a top-level {op.operation.name}")
        funcs[ir.StringAttr(op.attributes["sym_name"]).value] = op
    if "main" not in funcs:
        raise Unsupported("no main function")
    return _Planner(funcs).function("main")


def call(plan: Plan, args: Sequence[Any]) -> tuple[Array, ...]:
    """Run a plan on any arrays (JAX arrays are read in place on the host); raises
    `NotExact` where it cannot give XLA's bits."""
    arrays = [np.asarray(a) for a in args]
    for array in arrays:
        _refuse_subnormals(array)
    outs = [np.asarray(o) for o in plan(*arrays)]
    return tuple(o if o.flags.c_contiguous and o.flags.writeable else o.copy() for o in outs)


# ---------------------------------------------------------------- planning


def _tensor(value: ir.Value) -> tuple[tuple[int, ...], np.dtype]:
    """The value's shape and dtype (read once per type of the context `plan` runs in: types
    are unique within a context)."""
    vtype = value.type
    found = _contexts.types.get(vtype)
    return found if found is not None else _new_type(vtype)


def _new_type(vtype: ir.Type) -> tuple[tuple[int, ...], np.dtype]:
    try:
        ttype = ir.RankedTensorType(vtype)
    except ValueError:
        raise Unsupported(f"a value of type {vtype}") from None
    dtype = DTYPES.get(str(ttype.element_type))
    if dtype is None:
        raise Unsupported(f"element type {ttype.element_type}")
    found = _contexts.types[vtype] = (tuple(ttype.shape), dtype)
    return found


def _checked_result(value: ir.Value) -> tuple[tuple[int, ...], np.dtype]:
    """An op result's shape and dtype; raises `Unsupported` for one too big to hold
    (checked once per type)."""
    vtype = value.type
    found = _contexts.types.get(vtype)
    if found is None:
        found = _new_type(vtype)
    checked = _contexts.checked
    if vtype not in checked:
        shape, dtype = found
        if math.prod(shape) * dtype.itemsize > VALUE_LIMIT_BYTES:
            raise Unsupported(f"a value of {shape} {dtype}, over {VALUE_LIMIT_BYTES >> 20} MiB")
        checked.add(vtype)
    return found


def _ints(attr: ir.Attribute) -> tuple[int, ...]:
    """An integer array attribute's values (read once per attribute of the context: attributes
    are unique within a context, and a module repeats the same few)."""
    ints = _contexts.ints
    found = ints.get(attr)
    if found is None:
        if isinstance(attr, ir.DenseI64ArrayAttr):
            found = tuple(ir.DenseI64ArrayAttr(attr))
        elif isinstance(attr, ir.DenseIntElementsAttr):
            found = tuple(int(v) for v in np.asarray(ir.DenseIntElementsAttr(attr)).ravel())
        else:
            raise Unsupported(f"attribute {attr}")
        ints[attr] = found
    return found


class _Planner:
    """Plans a module's functions, each once; `func.call` runs the callee's plan."""

    def __init__(self, funcs: dict[str, Any]) -> None:
        self.funcs = funcs
        self.plans: dict[str, Plan] = {}
        self.open: set[str] = set()

    def function(self, name: str) -> Plan:
        if name in self.plans:
            return self.plans[name]
        if name not in self.funcs or name in self.open:
            raise Unsupported(f"a call of {name!r}")
        self.open.add(name)
        region = self.funcs[name].regions[0]
        if len(region.blocks) != 1:
            raise Unsupported(f"function {name!r} of several blocks")
        built = _Block(self, region.blocks[0]).build()
        self.open.discard(name)
        self.plans[name] = built
        return built


class _Block:
    """Plans one block: slots for its values, constants folded, steps in order."""

    def __init__(self, planner: _Planner, block: ir.Block) -> None:
        self.planner = planner
        self.block = block
        self.slots: dict[ir.Value, int] = {}
        self.known: dict[int, Any] = {}
        self.steps: list[tuple[Fn, tuple[int, ...], int | tuple[int, ...]]] = []
        self.results: tuple[int, ...] = ()
        self.bounds: dict[int, float | None] = {}
        """What `bound` found, by slot."""
        self._bounding = 0
        self.rows: dict[int, tuple[int, int, int]] = {}
        """Row gathers read only through slices of one row, by the slot of their result
        (never filled): (the vector's slot, the starts' slot, the rows' width)."""

    def slot(self, value: ir.Value) -> int:
        found = self.slots.get(value)
        if found is None:
            found = self.slots[value] = len(self.slots)
        return found

    def bound(self, value: ir.Value) -> float | None:
        """B such that every element of `value` is an integer with |v| <= B, where planning
        knows one: a constant's largest element, what `_BOUNDS` makes of the op that gives
        it (asked only for what a product reads, through at most `BOUND_DEPTH` ops), or an
        integer type's range."""
        slot = self.slot(value)
        if slot in self.bounds:
            return self.bounds[slot]
        found = None
        if slot in self.known:
            found = _constant_bound(np.asarray(self.known[slot]))
        else:
            owner = getattr(value.owner, "operation", None)  # None: a block's argument
            rule = None if owner is None else _BOUNDS.get(owner.name)
            if owner is not None and rule is not None and self._bounding < BOUND_DEPTH:
                self._bounding += 1
                try:
                    found = rule(self, owner)
                finally:
                    self._bounding -= 1
            if found is None:
                _, dtype = _tensor(value)
                if dtype.kind in "iu":
                    found = _at_least(_int_magnitude(dtype))
        self.bounds[slot] = found
        return found

    def build(self) -> Plan:
        params = tuple(self.slot(arg) for arg in self.block.arguments)
        for arg in self.block.arguments:
            _tensor(arg)
        for op in self.block.operations:
            self.add(op.operation)
        return self.finish(params)

    def add(self, op: ir.Operation) -> None:
        name = op.name
        slot = self.slot
        if name in ("func.return", "stablehlo.return"):
            self.results = tuple(slot(v) for v in op.operands)
            return
        results = list(op.results)
        tensors = [_checked_result(result) for result in results]
        _contexts.planning = (op, tensors[0] if tensors else None)
        handler = _HANDLERS.get(name)
        if handler is None:
            raise Unsupported(f"op {name}")
        if name in _ZERO_DROPPING:
            kept = self._zero_added(op, name)
            if kept is not None:
                self.slots[results[0]] = slot(kept)
                return
        if name == "stablehlo.gather" and self._gathered_rows(op):
            return
        ins = tuple([slot(v) for v in op.operands])
        if name == "stablehlo.slice" and ins[0] in self.rows:
            vector, starts, width = self.rows[ins[0]]
            fn, ins = _row_slice(op, width), (vector, starts)
        else:
            fn = handler(self, op)
        outs = tuple([slot(r) for r in results])
        out: int | tuple[int, ...] = outs[0] if len(outs) == 1 else outs
        known = self.known
        if all(i in known for i in ins) and name not in _NOT_FOLDED:
            try:
                with np.errstate(all="ignore"):
                    value = fn(*[known[i] for i in ins])
            except NotExact as exc:  # a constant the plan cannot give XLA's bits of
                raise Unsupported(str(exc)) from None
            values = (value,) if isinstance(out, int) else tuple(value)
            if all(_foldable(v) for v in values):
                for at, v in zip(outs, values, strict=True):
                    if _has_subnormals(np.asarray(v)):  # folded by XLA too, as it is here
                        raise Unsupported(f"a subnormal constant from {name}")
                    known[at] = v
                return
        if name in _SUBNORMAL_SOURCES and _may_make_subnormals(op, name):
            fn = _refusing_subnormals(fn, nans=name in _ARITHMETIC)
        self.steps.append((fn, ins, out))

    def _gathered_rows(self, op: ir.Operation) -> bool:
        """Whether `op` gathers rows of a vector (not a constant) that only slices of one
        row each read: each such slice then copies its part of the vector itself (a round
        reading its PRF streams), and the rows are never gathered whole."""
        width = _row_width(op)
        if width is None or self.slot(op.operands[0]) in self.known:
            return False
        result = op.results[0]
        for use in result.uses:
            user = use.owner
            if user.name != "stablehlo.slice":
                return False
            begin, end = (_ints(user.attributes[k]) for k in ("start_indices", "limit_indices"))
            if end[0] - begin[0] != 1:
                return False
        vector, starts = (self.slot(v) for v in op.operands)
        self.rows[self.slot(result)] = (vector, starts, width)
        return True

    def _is_zero(self, value: ir.Value) -> bool:
        found = self.known.get(self.slot(value))
        return found is not None and not np.any(_unbroadcast(np.asarray(found)))

    def _zero_added(self, op: ir.Operation, name: str) -> ir.Value | None:
        """The other operand where `op` (an add or a subtract, named `name`) adds a constant
        zero to a float, or subtracts one from it: XLA's simplifier drops such an op, so
        -0.0 + 0.0 gives -0.0 there."""
        if _result(op)[1].kind != "f":
            return None
        if self._is_zero(op.operands[1]):
            return op.operands[0]
        if name == "stablehlo.add" and self._is_zero(op.operands[0]):
            return op.operands[1]
        return None

    def finish(self, params: tuple[int, ...]) -> Plan:
        last: dict[int, int] = {}
        for index, (_, ins, _) in enumerate(self.steps):
            for slot in ins:
                last[slot] = index
        kept = set(self.results)
        steps = []
        for index, (fn, ins, out) in enumerate(self.steps):
            dead = [s for s in ins if last[s] == index and s not in kept]
            for s in (out,) if isinstance(out, int) else out:
                if s not in last and s not in kept:
                    dead.append(s)
            frees = tuple(sorted(set(dead))) if len(dead) > 1 else tuple(dead)
            steps.append(Step(fn, ins, out, frees))
        used = last.keys() | kept
        constants = tuple((s, v) for s, v in self.known.items() if s in used)
        weight = sum(_held_bytes(v) for _, v in constants) + STEP_BYTES * len(steps)
        return Plan(len(self.slots), constants, params, tuple(steps), self.results, weight)


def _constant_bound(value: Array) -> float | None:
    """The largest magnitude of a constant whose elements are all integers, else None."""
    if value.size == 0:
        return 0.0
    value = _unbroadcast(value)
    if value.dtype.kind in "iu":
        return _at_least(max(int(value.max()), -int(value.min())))
    if value.dtype.kind == "f" and value.nbytes <= KEPT_CONSTANT_BYTES:
        return float(np.max(np.abs(value))) if np.array_equal(value, np.trunc(value)) else None
    return None  # (a big float constant is checked at each call, in chunks)


def _unbroadcast(value: Array) -> Array:
    """The elements a broadcast view holds (one along each axis it repeats)."""
    return value[tuple(slice(0, 1) if step == 0 else slice(None) for step in value.strides)]


def _int_magnitude(dtype: np.dtype, largest: bool = True) -> int:
    """The largest magnitude an integer type holds with `largest`, else the largest B such
    that every integer in [-B, B] fits (0 for an unsigned type)."""
    info = np.iinfo(dtype)
    pick = max if largest else min
    return pick(-int(info.min), int(info.max))


def _at_least(n: int) -> float:
    """The float nearest n that is not below it."""
    found = float(n)
    return found if found >= n else math.nextafter(found, math.inf)


def _same_bound(block: _Block, op: ir.Operation) -> float | None:
    """Ops that only move, copy or pick elements: the operands' bound."""
    bounds = [block.bound(v) for v in op.operands]
    return None if None in bounds else max(bounds)  # type: ignore[type-var]


def _and_bound(block: _Block, op: ir.Operation) -> float | None:
    """x & c of unsigned integers is at most c."""
    _, dtype = _result(op)
    if dtype.kind != "u":
        return None
    bounds = [b for v in op.operands if (b := block.bound(v)) is not None]
    return min(bounds) if bounds else None


def _convert_bound(block: _Block, op: ir.Operation) -> float | None:
    """Integers converted to a type that holds each exactly keep their bound."""
    _, source = _tensor(op.operands[0])
    _, target = _result(op)
    found = block.bound(op.operands[0])
    if found is None or target.kind not in "iuf":
        return None
    if target.kind == "f":
        return found if source.kind in "iuf" and found <= _exact_bound(target) else None
    fits = source.kind in "iu" and found <= _int_magnitude(target, largest=False)
    return found if fits else None


_BOUNDS: dict[str, Callable[[_Block, ir.Operation], float | None]] = {
    **{
        f"stablehlo.{name}": _same_bound
        for name in ("reshape", "transpose", "broadcast_in_dim", "slice", "reverse", "concatenate")
    },
    "stablehlo.and": _and_bound,
    "stablehlo.convert": _convert_bound,
}
"""How an op's result is bounded (see `_Block.bound`): what lets a float sum of chunks of
ring elements (each below 2^c by its mask, converted to f64) run with no check that it is
exact, as `_check_exact` makes of sums it cannot bound."""


def _held_bytes(value: Any) -> int:
    """The memory an array holds: a broadcast view counts its unbroadcast elements only."""
    array = np.asarray(value)
    held = [n for n, stride in zip(array.shape, array.strides, strict=True) if stride != 0]
    return math.prod(held) * array.itemsize


def _foldable(value: Any) -> bool:
    return _held_bytes(value) <= FOLD_LIMIT_BYTES


_NOT_FOLDED = frozenset({"func.call"})
_ZERO_DROPPING = frozenset({"stablehlo.add", "stablehlo.subtract"})

_SUBNORMAL_SOURCES = frozenset(
    f"stablehlo.{name}"
    for name in (
        "add",
        "subtract",
        "multiply",
        "divide",
        "remainder",
        "convert",
        "bitcast_convert",
        "scatter",
    )
)
"""Ops whose float results may be subnormal where their operands are not (the others move,
pick, negate or round what they read, or sum only integral values; a conversion only from a
float); a call checks what these give."""


def _may_make_subnormals(op: ir.Operation, name: str) -> bool:
    """Whether `op`, one of `_SUBNORMAL_SOURCES` named `name`, may make a subnormal float."""
    if _result(op)[1].kind != "f":
        return False
    return name != "stablehlo.convert" or _tensor(op.operands[0])[1].kind == "f"


_ARITHMETIC = frozenset(
    f"stablehlo.{name}" for name in ("add", "subtract", "multiply", "divide", "remainder")
)
"""Float ops whose NaN results XLA's code and numpy's may give other bits of."""


def _has_subnormals(array: Array, nans: bool = False) -> bool:
    """Whether `array` holds a subnormal float (or, with `nans`, a NaN). Read in chunks,
    so a big argument costs no copy of itself."""
    if array.dtype.kind != "f" or array.size == 0:
        return False
    flat = _unbroadcast(array).reshape(-1)
    tiny = np.finfo(array.dtype).tiny
    for start in range(0, flat.size, CHECK_CHUNK):
        chunk = flat[start : start + CHECK_CHUNK]
        # zeros and subnormals are below tiny; a NaN is not at or above it either
        small = ~(np.abs(chunk) >= tiny) if nans else np.abs(chunk) < tiny
        if small.any() and np.any(chunk[small]):
            return True
    return False


def _refuse_subnormals(array: Array, nans: bool = False) -> None:
    if _has_subnormals(array, nans):
        raise NotExact(
            "a subnormal float (XLA's code reads and writes it as zero)"
            + (", or a NaN from arithmetic (of two, XLA's code keeps another)" if nans else "")
        )


def _refusing_subnormals(fn: Fn, nans: bool) -> Fn:
    def refusing(*args: Any) -> Any:
        out = fn(*args)
        _refuse_subnormals(np.asarray(out), nans)
        return out

    return refusing


# ---------------------------------------------------------------- op handlers

Handler = Callable[[_Block, ir.Operation], Fn]
_HANDLERS: dict[str, Handler] = {}


def _handles(*names: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for name in names:
            _HANDLERS[f"stablehlo.{name}"] = handler
        return handler

    return register


def _result(op: ir.Operation, index: int = 0) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of `op`'s result `index` (the first result of the op being
    planned is known already)."""
    if index == 0:
        planned, found = _contexts.planning
        if planned is op:
            return found
    return _tensor(op.results[index])


def _typed(fn: Fn, dtype: np.dtype) -> Fn:
    def typed(*args: Any) -> Any:
        return np.asarray(fn(*args), dtype)

    return typed


_ELEMENTWISE: dict[str, Fn] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "shift_left": np.left_shift,
    "not": np.invert,
    "negate": np.negative,
    "abs": np.abs,
    "round_nearest_even": np.rint,
    "floor": np.floor,
    "ceil": np.ceil,
    "sqrt": np.sqrt,
    "popcnt": lambda x: np.bitwise_count(np.asarray(x).view(f"u{np.asarray(x).itemsize}")),
    "select": np.where,
}
_INTEGER_ONLY = frozenset({"shift_left", "popcnt"})
_FLOAT_ONLY = frozenset({"round_nearest_even", "floor", "ceil", "sqrt"})


@_handles(*_ELEMENTWISE)
def _elementwise(block: _Block, op: ir.Operation) -> Fn:
    name = op.name.removeprefix("stablehlo.")
    _, dtype = _result(op)
    is_float = dtype.kind == "f"
    if (name in _INTEGER_ONLY and is_float) or (name in _FLOAT_ONLY and not is_float):
        raise Unsupported(f"{name} on {dtype}")
    if name in ("and", "or", "xor", "not") and is_float:
        raise Unsupported(f"{name} on {dtype}")
    if is_float and name in _ORDERED_ZEROS:
        return _ORDERED_ZEROS[name]
    fn = _ELEMENTWISE[name]
    # numpy keeps the operands' dtype for all of these but popcnt (uint8): no wrapper per call
    return _typed(fn, dtype) if name == "popcnt" else fn


def _float_maximum(x: Array, y: Array) -> Array:
    """XLA's maximum of floats: +0.0 above -0.0 (numpy's gives either of two zeros)."""
    out = np.maximum(x, y)
    _refuse_nans(out)
    zeros = (x == 0) & (y == 0)
    return np.where(zeros, np.add(x, y), out) if zeros.any() else out  # -0 only from -0 + -0


def _float_minimum(x: Array, y: Array) -> Array:
    """XLA's minimum of floats: -0.0 below +0.0."""
    out = np.minimum(x, y)
    _refuse_nans(out)
    zeros = (x == 0) & (y == 0)
    if not zeros.any():
        return out
    return np.where(zeros, np.negative(np.add(np.negative(x), np.negative(y))), out)


def _refuse_nans(out: Array) -> None:
    if np.isnan(out).any():
        raise NotExact(
            "a NaN from a float maximum or minimum (XLA's code sets its sign its own way)"
        )


_ORDERED_ZEROS: dict[str, Fn] = {"maximum": _float_maximum, "minimum": _float_minimum}


@_handles("shift_right_logical", "shift_right_arithmetic")
def _shift_right(block: _Block, op: ir.Operation) -> Fn:
    _, dtype = _result(op)
    if dtype.kind not in "iu":
        raise Unsupported(f"a shift of {dtype}")
    arithmetic = op.name.endswith("arithmetic")
    as_dtype = np.dtype(f"{'i' if arithmetic else 'u'}{dtype.itemsize}")

    # numpy's shifts give 0 (or the sign) past the width, as XLA's do; a negative amount
    # counts as a large unsigned one in both
    if as_dtype == dtype:
        return np.right_shift

    def shift(x: Array, amount: Array) -> Array:
        x = np.asarray(x).view(as_dtype)
        amount = np.asarray(amount).view(as_dtype)
        return np.asarray(np.right_shift(x, amount)).view(dtype)

    return shift


@_handles("divide", "remainder")
def _divide(block: _Block, op: ir.Operation) -> Fn:
    _, dtype = _result(op)
    remainder = op.name.endswith("remainder")
    if dtype.kind == "f":
        return _typed(np.fmod if remainder else np.divide, dtype)
    if dtype.kind == "b":
        raise Unsupported("division of booleans")
    low = np.iinfo(dtype).min

    def divide(x: Array, y: Array) -> Array:
        x, y = np.broadcast_arrays(np.asarray(x, dtype), np.asarray(y, dtype))
        zero = y == 0
        overflow = (x == low) & (y == -1) if low < 0 else np.zeros_like(zero)
        safe = np.where(zero | overflow, 1, y).astype(dtype)
        rem = np.fmod(x, safe)  # C's remainder: the sign of x
        if remainder:
            return np.where(zero, x, np.where(overflow, 0, rem)).astype(dtype)
        quotient = ((x - rem) // safe).astype(dtype)
        quotient = np.where(overflow, x, quotient)
        return np.where(zero, np.asarray(-1).astype(dtype), quotient).astype(dtype)

    return divide


@_handles("sign")
def _sign(block: _Block, op: ir.Operation) -> Fn:
    _, dtype = _result(op)
    if dtype.kind == "u" or dtype.kind == "b":
        raise Unsupported(f"sign of {dtype}")
    if dtype.kind == "f":  # a signed zero keeps its sign, as XLA's does
        return _typed(lambda x: np.where(x == 0, x, np.sign(x)), dtype)
    return _typed(np.sign, dtype)


@_handles("clamp")
def _clamp(block: _Block, op: ir.Operation) -> Fn:
    _, dtype = _result(op)
    if dtype.kind == "f":
        return _typed(lambda low, x, high: _float_minimum(_float_maximum(x, low), high), dtype)
    return _typed(lambda low, x, high: np.minimum(np.maximum(x, low), high), dtype)


_DIRECTIONS: dict[str, Fn] = {
    "EQ": np.equal,
    "NE": np.not_equal,
    "LT": np.less,
    "LE": np.less_equal,
    "GT": np.greater,
    "GE": np.greater_equal,
}


@_handles("compare")
def _compare(block: _Block, op: ir.Operation) -> Fn:
    direction = hlo.ComparisonDirectionAttr(op.attributes["comparison_direction"]).value
    compare = _DIRECTIONS[direction]
    kind = "NOTYPE"
    if "compare_type" in op.attributes:
        kind = hlo.ComparisonTypeAttr(op.attributes["compare_type"]).value
    _, operand = _tensor(op.operands[0])
    if kind == "TOTALORDER" and operand.kind == "f":
        as_int = np.dtype(f"i{operand.itemsize}")
        magnitude = np.asarray(np.iinfo(as_int).max, as_int)

        def total(x: Array) -> Array:
            bits = np.asarray(x).view(as_int)
            return np.where(bits < 0, bits ^ magnitude, bits)

        return lambda x, y: compare(total(x), total(y))
    if kind in ("SIGNED", "UNSIGNED") and operand.kind in "iu":
        as_dtype = np.dtype(f"{'i' if kind == 'SIGNED' else 'u'}{operand.itemsize}")
        if as_dtype != operand:
            return lambda x, y: compare(np.asarray(x).view(as_dtype), np.asarray(y).view(as_dtype))
    return compare


@_handles("convert")
def _convert(block: _Block, op: ir.Operation) -> Fn:
    _, source = _tensor(op.operands[0])
    _, target = _result(op)
    if target.kind == "b":
        return lambda x: np.not_equal(x, 0)
    if source.kind == "f" and target.kind in "iu":
        return lambda x: _float_to_int(np.asarray(x), target)
    return lambda x: np.asarray(x).astype(target)


def _float_to_int(x: Array, dtype: np.dtype) -> Array:
    """XLA's conversion: toward zero, saturating at the type's range, NaN to 0."""
    info = np.iinfo(dtype)
    low, high = float(info.min), float(info.max) + 1.0  # both powers of two (or 0): exact
    if x.size and low <= x.min() and x.max() < high:  # all in range (a NaN fails both)
        return x.astype(dtype)  # numpy's conversion also truncates toward zero
    whole = np.trunc(x)
    inside = (whole >= low) & (whole < high)
    out = np.where(inside, whole, 0).astype(dtype)
    out = np.where(whole >= high, np.asarray(info.max, dtype), out)
    return np.where(whole < low, np.asarray(info.min, dtype), out)


@_handles("bitcast_convert")
def _bitcast(block: _Block, op: ir.Operation) -> Fn:
    shape, target = _result(op)

    def bitcast(x: Array) -> Array:
        return np.ascontiguousarray(x).view(target).reshape(shape)

    return bitcast


@_handles("round_nearest_afz")
def _round_away(block: _Block, op: ir.Operation) -> Fn:
    _, dtype = _result(op)
    if dtype.kind != "f":
        raise Unsupported(f"rounding of {dtype}")

    def round_away(x: Array) -> Array:
        whole = np.trunc(x)
        away = np.abs(x - whole) >= 0.5
        return np.where(away, whole + np.sign(x), whole).astype(dtype)

    return round_away


@_handles("constant")
def _constant(block: _Block, op: ir.Operation) -> Fn:
    """The value, read once per attribute of the context `plan` runs in (attributes, their
    type included, are unique within a context, and a module's rounds repeat their masks)."""
    attr = op.attributes["value"]
    if not isinstance(attr, ir.DenseElementsAttr):
        raise Unsupported(f"constant {attr}")
    constants = _contexts.constants
    value = constants.get(attr)
    if value is None:
        value = _dense_value(ir.DenseElementsAttr(attr), *_result(op))
        if _held_bytes(value) <= KEPT_CONSTANT_BYTES:  # a big one stays its plan's alone
            constants[attr] = value
    return lambda: value


def _dense_value(dense: Any, shape: tuple[int, ...], dtype: np.dtype) -> Array:
    """A dense attribute's elements as a read-only `dtype` array of `shape` (a splat's one
    element broadcast)."""
    if dense.is_splat:
        scalar = dense.get_splat_value()
        if dtype.kind == "f":
            item: Any = ir.FloatAttr(scalar).value
        else:
            item = ir.IntegerAttr(scalar).value
            item = item != 0 if dtype.kind == "b" else item % (1 << (8 * dtype.itemsize))
        value = np.broadcast_to(np.array(item).astype(dtype), shape)  # held once
    else:
        value = np.array(dense).astype(dtype).reshape(shape)
    value.flags.writeable = False
    return value


@_handles("iota")
def _iota(block: _Block, op: ir.Operation) -> Fn:
    shape, dtype = _result(op)
    axis = ir.IntegerAttr(op.attributes["iota_dimension"]).value
    line = np.arange(shape[axis]).astype(dtype)
    value = np.broadcast_to(
        line.reshape([n if d == axis else 1 for d, n in enumerate(shape)]), shape
    )
    return lambda: value


@_handles("broadcast_in_dim")
def _broadcast(block: _Block, op: ir.Operation) -> Fn:
    shape, _ = _result(op)
    dims = _ints(op.attributes["broadcast_dimensions"])
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    placed = [1] * len(shape)
    operand_shape, _ = _tensor(op.operands[0])
    for i in order:
        placed[dims[i]] = operand_shape[i]

    transposed = order != sorted(order)
    placed_shape = tuple(placed)
    _, dtype = _result(op)
    copied = math.prod(shape) * dtype.itemsize <= BROADCAST_COPY_BYTES

    def broadcast(x: Array) -> Array:
        x = np.asarray(x)
        if transposed:
            x = x.transpose(order)
        if copied:  # a new array is cheaper than a broadcast view this small
            out = np.empty(shape, dtype)
            out[...] = x.reshape(placed_shape)
            return out
        return np.broadcast_to(x.reshape(placed_shape), shape)

    return broadcast


@_handles("reshape")
def _reshape(block: _Block, op: ir.Operation) -> Fn:
    shape, _ = _result(op)
    return lambda x: np.asarray(x).reshape(shape)  # the method: a quarter of np.reshape's cost


@_handles("transpose")
def _transpose(block: _Block, op: ir.Operation) -> Fn:
    permutation = _ints(op.attributes["permutation"])
    return lambda x: np.transpose(x, permutation)


@_handles("reverse")
def _reverse(block: _Block, op: ir.Operation) -> Fn:
    axes = tuple(_ints(op.attributes["dimensions"]))
    return lambda x: np.flip(x, axes)


@_handles("slice")
def _slice(block: _Block, op: ir.Operation) -> Fn:
    index = tuple(
        slice(start, limit, stride)
        for start, limit, stride in zip(
            _ints(op.attributes["start_indices"]),
            _ints(op.attributes["limit_indices"]),
            _ints(op.attributes["strides"]),
            strict=True,
        )
    )
    return lambda x: np.asarray(x)[index]


def _starts(shape: Sequence[int], sizes: Sequence[int], starts: Sequence[Any]) -> list[int]:
    """Start indices clamped as XLA clamps them: the slice stays inside the operand."""
    return [min(max(int(s), 0), n - size) for s, n, size in zip(starts, shape, sizes, strict=True)]


@_handles("dynamic_slice")
def _dynamic_slice(block: _Block, op: ir.Operation) -> Fn:
    sizes = _ints(op.attributes["slice_sizes"])

    def dynamic_slice(x: Array, *starts: Array) -> Array:
        x = np.asarray(x)
        begin = _starts(x.shape, sizes, starts)
        return x[tuple(slice(b, b + n) for b, n in zip(begin, sizes, strict=True))]

    return dynamic_slice


@_handles("dynamic_update_slice")
def _dynamic_update_slice(block: _Block, op: ir.Operation) -> Fn:
    def dynamic_update_slice(x: Array, update: Array, *starts: Array) -> Array:
        out = np.array(x)
        update = np.asarray(update)
        begin = _starts(out.shape, update.shape, starts)
        out[tuple(slice(b, b + n) for b, n in zip(begin, update.shape, strict=True))] = update
        return out

    return dynamic_update_slice


@_handles("concatenate")
def _concatenate(block: _Block, op: ir.Operation) -> Fn:
    axis = ir.IntegerAttr(op.attributes["dimension"]).value if "dimension" in op.attributes else -1
    return lambda *xs: np.concatenate(xs, axis=axis)


@_handles("pad")
def _pad(block: _Block, op: ir.Operation) -> Fn:
    lows = _ints(op.attributes["edge_padding_low"])
    highs = _ints(op.attributes["edge_padding_high"])
    interiors = _ints(op.attributes["interior_padding"])
    shape, dtype = _result(op)

    def pad(x: Array, value: Array) -> Array:
        x = np.asarray(x)
        grown = [
            max(lo, 0) + (n + (n - 1) * inner if n else 0) + max(hi, 0)
            for n, lo, hi, inner in zip(x.shape, lows, highs, interiors, strict=True)
        ]
        out = np.full(grown, value, dtype)
        out[
            tuple(
                slice(max(lo, 0), max(lo, 0) + (n - 1) * (inner + 1) + 1, inner + 1)
                for n, lo, inner in zip(x.shape, lows, interiors, strict=True)
            )
        ] = x
        cut = tuple(
            slice(-min(lo, 0), size - (-min(hi, 0)))
            for size, lo, hi in zip(grown, lows, highs, strict=True)
        )
        return out[cut].reshape(shape)

    return pad


@_handles("optimization_barrier")
def _barrier(block: _Block, op: ir.Operation) -> Fn:
    return lambda *xs: xs


def _exact_bound(dtype: np.dtype) -> float:
    return float(2 ** (np.finfo(dtype).nmant + 1))


def _exact_as_planned(block: _Block, op: ir.Operation, terms: int, dtype: np.dtype) -> bool:
    """Whether every sum of `terms` products of the op's operands is exact in `dtype` by the
    operands' bounds alone (`_Block.bound`), so no call needs `_check_exact`."""
    product = float(max(terms, 1))
    for value in op.operands:
        found = block.bound(value)
        if found is None:
            return False
        product *= found
    return terms <= _exact_bound(dtype) and product <= _exact_bound(dtype)


def _check_exact(terms: int, *arrays: Array) -> None:
    """Raise NotExact unless sums of `terms` products of these float arrays are exact.

    Read in chunks, so a big operand costs no copy of itself."""
    bound = _exact_bound(arrays[0].dtype)
    if terms > bound:
        raise NotExact("a float sum of more terms than the mantissa holds")
    product = float(max(terms, 1))
    for a in arrays:
        flat = a.reshape(-1)
        largest = 0.0
        for start in range(0, flat.size, CHECK_CHUNK):
            chunk = flat[start : start + CHECK_CHUNK]
            if not np.array_equal(chunk, np.trunc(chunk)):
                raise NotExact("a float sum of non-integral values")
            largest = max(largest, float(np.max(np.abs(chunk))))
        product *= largest
    if not product <= bound:
        raise NotExact("a float sum that may round")


@_handles("dot_general")
def _dot_general(block: _Block, op: ir.Operation) -> Fn:
    numbers = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    lhs_batch = list(numbers.lhs_batching_dimensions)
    rhs_batch = list(numbers.rhs_batching_dimensions)
    lhs_contract = list(numbers.lhs_contracting_dimensions)
    rhs_contract = list(numbers.rhs_contracting_dimensions)
    lhs_shape, _ = _tensor(op.operands[0])
    rhs_shape, _ = _tensor(op.operands[1])
    _, dtype = _result(op)
    letters = iter(string.ascii_letters)
    lhs = [""] * len(lhs_shape)
    rhs = [""] * len(rhs_shape)
    for a, b in (
        *zip(lhs_batch, rhs_batch, strict=True),
        *zip(lhs_contract, rhs_contract, strict=True),
    ):
        lhs[a] = rhs[b] = next(letters)
    for labels in (lhs, rhs):
        for i, label in enumerate(labels):
            if not label:
                labels[i] = next(letters)
    out = (
        [lhs[d] for d in lhs_batch]
        + [lhs[d] for d in range(len(lhs)) if d not in lhs_batch and d not in lhs_contract]
        + [rhs[d] for d in range(len(rhs)) if d not in rhs_batch and d not in rhs_contract]
    )
    spec = f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"
    terms = int(np.prod([lhs_shape[d] for d in lhs_contract]))
    floats = dtype.kind == "f"  # BLAS, whose sums of exact integers are exact in any order
    checked = floats and not _exact_as_planned(block, op, terms, dtype)

    def dot_general(x: Array, y: Array) -> Array:
        x, y = np.asarray(x, dtype), np.asarray(y, dtype)
        if checked:
            _check_exact(terms, x, y)
        return np.einsum(spec, x, y, optimize=floats).astype(dtype)

    return dot_general


_REDUCERS: dict[str, np.ufunc] = {
    "stablehlo.add": np.add,
    "stablehlo.multiply": np.multiply,
    "stablehlo.maximum": np.maximum,
    "stablehlo.minimum": np.minimum,
    "stablehlo.and": np.bitwise_and,
    "stablehlo.or": np.bitwise_or,
    "stablehlo.xor": np.bitwise_xor,
}


@_handles("reduce")
def _reduce(block: _Block, op: ir.Operation) -> Fn:
    if len(op.operands) != 2:
        raise Unsupported("a reduce of several operands")
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    args = list(body.arguments)
    if (
        len(ops) != 2
        or ops[0].name not in _REDUCERS
        or list(ops[0].operands) != args
        or list(ops[1].operands) != list(ops[0].results)
    ):
        raise Unsupported("a reduce with a body other than one binary op")
    ufunc = _REDUCERS[ops[0].name]
    axes = tuple(_ints(op.attributes["dimensions"]))
    _, dtype = _result(op)
    if dtype.kind == "b" and ufunc in (np.add, np.multiply):
        raise Unsupported("a sum of booleans")
    sums = ufunc in (np.add, np.multiply)
    extreme = dtype.kind == "f" and ufunc in (np.maximum, np.minimum)

    def reduce(x: Array, init: Array) -> Array:
        x = np.asarray(x)
        if dtype.kind == "f" and sums:
            terms = int(np.prod([x.shape[a] for a in axes])) + 1
            if ufunc is np.multiply:
                raise NotExact("a float product")
            _check_exact(terms, x)
            _check_exact(terms, np.asarray(init))
        if extreme:
            return _float_extreme(ufunc, x, axes, init).astype(dtype)
        return ufunc(ufunc.reduce(x, axis=axes), init).astype(dtype)

    return reduce


def _float_extreme(ufunc: np.ufunc, x: Array, axes: tuple[int, ...], init: Array) -> Array:
    """XLA's float max (or min) reduction: a zero extreme is +0.0 (-0.0) where one of the
    zeros is, whatever order numpy took them in."""
    maximum = ufunc is np.maximum
    out = ufunc.reduce(x, axis=axes)
    _refuse_nans(out)
    zero = out == 0
    if np.any(zero):
        wanted = np.any((x == 0) & (np.signbit(x) != maximum), axis=axes)
        signed = np.where(wanted == maximum, 0.0, -0.0).astype(out.dtype)
        out = np.where(zero, signed, out)
    return (_float_maximum if maximum else _float_minimum)(out, init)


@_handles("sort")
def _sort(block: _Block, op: ir.Operation) -> Fn:
    """A stable sort by one integer key, ascending or descending (the comparator one LT or GT
    of the first operand's two elements, as `jnp.sort` and `jnp.argsort` write it): numpy's
    stable argsort puts equal keys in XLA's order, first come first."""
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    args = list(body.arguments)
    if "is_stable" not in op.attributes or not ir.BoolAttr(op.attributes["is_stable"]).value:
        raise Unsupported("an unstable sort (its order of equal keys is XLA's own)")
    if (
        len(ops) != 2
        or ops[0].name != "stablehlo.compare"
        or list(ops[0].operands) != args[:2]
        or list(ops[1].operands) != list(ops[0].results)
    ):
        raise Unsupported("a sort whose comparator is not one comparison of the first operand")
    direction = hlo.ComparisonDirectionAttr(ops[0].attributes["comparison_direction"]).value
    _, key = _tensor(op.operands[0])
    kind = "NOTYPE"
    if "compare_type" in ops[0].attributes:
        kind = hlo.ComparisonTypeAttr(ops[0].attributes["compare_type"]).value
    signed = {"i": "SIGNED", "u": "UNSIGNED"}.get(key.kind)
    if direction not in ("LT", "GT") or signed is None or kind not in (signed, "NOTYPE"):
        raise Unsupported(f"a sort by {direction} ({kind}) on {key}")
    axis = ir.IntegerAttr(op.attributes["dimension"]).value if "dimension" in op.attributes else -1
    descending = direction == "GT"

    def sort(*operands: Array) -> Array | tuple[Array, ...]:
        keys = np.asarray(operands[0])
        # ~k reverses the order of signed and of unsigned integers alike, one to one
        order = np.argsort(~keys if descending else keys, axis=axis, kind="stable")
        out = tuple(np.take_along_axis(np.asarray(o), order, axis=axis) for o in operands)
        return out if len(out) > 1 else out[0]

    return sort


@_handles("scatter")
def _scatter(block: _Block, op: ir.Operation) -> Fn:
    """A scatter that puts each update at one index of a vector (`x.at[i].set(u)` with x
    1-D): out-of-range indices are dropped, as XLA drops them. XLA leaves the winner of two
    updates at one index open, so such a call raises `NotExact` and the caller compiles."""
    if len(op.operands) != 3:
        raise Unsupported("a scatter of several operands")
    numbers = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    (operand_shape, _), (index_shape, _) = _tensor(op.operands[0]), _tensor(op.operands[1])
    if (
        len(operand_shape) != 1
        or len(index_shape) != 2
        or index_shape[1] != 1
        or list(numbers.update_window_dims)
        or list(numbers.inserted_window_dims) != [0]
        or list(numbers.scattered_dims_to_operand_dims) != [0]
        or numbers.index_vector_dim != 1
        or list(numbers.input_batching_dims)
        or len(ops) != 1
        or list(ops[0].operands) != [body.arguments[1]]
    ):
        raise Unsupported("a scatter other than updates put at indices of a vector")

    def scatter(x: Array, indices: Array, updates: Array) -> Array:
        out = np.array(x)
        at = np.asarray(indices)[:, 0].astype(np.int64)
        inside = (at >= 0) & (at < out.shape[0])
        at = at[inside]
        if at.size and np.bincount(at, minlength=out.shape[0]).max() > 1:
            raise NotExact("a scatter of two updates to one index")
        out[at] = np.asarray(updates)[inside]
        return out

    return scatter


@_handles("gather")
def _gather(block: _Block, op: ir.Operation) -> Fn:
    numbers = hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    offset_dims = list(numbers.offset_dims)
    start_map = list(numbers.start_index_map)
    vector_dim = numbers.index_vector_dim
    operand_batch = list(numbers.operand_batching_dims)
    index_batch = list(numbers.start_indices_batching_dims)
    dropped = set(numbers.collapsed_slice_dims) | set(operand_batch)
    sizes = _ints(op.attributes["slice_sizes"])
    shape, _ = _result(op)
    width = _row_width(op)
    if width is not None:
        return _row_gather(width)
    operand = _tensor(op.operands[0])[0]
    if (
        len(start_map) == 1
        and dropped == set(start_map)
        and not operand_batch
        and all(n == (1 if d in dropped else operand[d]) for d, n in enumerate(sizes))
    ):
        return _take(start_map[0], vector_dim, offset_dims, len(shape))

    def gather(x: Array, indices: Array) -> Array:
        x, indices = np.asarray(x), np.asarray(indices)
        if vector_dim == indices.ndim:
            indices = indices[..., None]
        else:
            indices = np.moveaxis(indices, vector_dim, -1)
        indices = _as_int64(indices)
        batch = indices.shape[:-1]
        rank = x.ndim
        grids = []
        for d in range(rank):
            start = np.zeros(batch, np.int64)
            if d in start_map:
                start = np.clip(indices[..., start_map.index(d)], 0, x.shape[d] - sizes[d])
            elif d in operand_batch:  # the index's own position along its paired batch axis
                axis = index_batch[operand_batch.index(d)]
                axis -= axis > vector_dim
                start = np.broadcast_to(
                    np.arange(batch[axis]).reshape(
                        [-1 if a == axis else 1 for a in range(len(batch))]
                    ),
                    batch,
                )
            offsets = np.arange(sizes[d]).reshape([sizes[d] if e == d else 1 for e in range(rank)])
            grids.append(start.reshape(batch + (1,) * rank) + offsets)
        full = x[tuple(grids)]
        kept = tuple(n for d, n in enumerate(sizes) if d not in dropped)
        full = full.reshape(batch + kept)
        order, batch_axes = [], iter(range(len(batch)))
        for position in range(len(shape)):
            if position in offset_dims:
                order.append(len(batch) + offset_dims.index(position))
            else:
                order.append(next(batch_axes))
        return full.transpose(order)

    return gather


def _take(axis: int, vector_dim: int, offset_dims: list[int], rank: int) -> Fn:
    """A gather of whole slices along one `axis` at clamped indices (a permutation, a
    lookup in a table): numpy's `take` there, its axes then put where the gather puts them
    (the general gather indexes every element)."""

    def take(x: Array, indices: Array) -> Array:
        x, indices = np.asarray(x), np.asarray(indices)
        if vector_dim < indices.ndim:  # its index vector (one index long) dropped
            indices = indices.reshape(indices.shape[:vector_dim] + indices.shape[vector_dim + 1 :])
        taken = np.take(x, _as_int64(indices), axis=axis, mode="clip")
        batch = indices.ndim
        kept = [d for d in range(taken.ndim) if not axis <= d < axis + batch]
        batch_axes = iter(range(axis, axis + batch))
        kept_axes = iter(kept)
        order = [next(kept_axes) if p in offset_dims else next(batch_axes) for p in range(rank)]
        return taken.transpose(order)

    return take


def _as_int64(indices: Array) -> Array:
    """Indices as int64, an unsigned one past int64's range at its top (all clamp alike)."""
    if indices.dtype.kind == "u":
        indices = np.minimum(indices.astype(np.uint64), np.uint64(np.iinfo(np.int64).max))
    return indices.astype(np.int64)


def _row_width(op: ir.Operation) -> int | None:
    """The width of the rows `op` gathers where it gathers rows of a vector (from
    int[rows, 1] or int[rows]), else None."""
    numbers = hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    dropped = list(numbers.collapsed_slice_dims) + list(numbers.operand_batching_dims)
    if list(numbers.offset_dims) != [1] or list(numbers.start_index_map) != [0] or dropped:
        return None
    return _ints(op.attributes["slice_sizes"])[0] if len(_result(op)[0]) == 2 else None


def _row_slice(op: ir.Operation, width: int) -> Fn:
    """A slice of one row of a row gather (`_row_gather`), read from the vector."""
    (row, first), (_, last) = (_ints(op.attributes[k]) for k in ("start_indices", "limit_indices"))
    step = _ints(op.attributes["strides"])[1]

    def row_slice(x: Array, indices: Array) -> Array:
        at = int(np.asarray(indices).reshape(-1)[row])  # a Python int: uint64 clamps too
        start = min(max(at, 0), x.shape[0] - width)
        return x[start + first : start + last : step].reshape(1, -1)

    return row_slice


def _row_gather(width: int) -> Fn:
    """A gather of rows of `width` elements of a vector from starts (int[rows, 1] or
    int[rows]), each clamped into range: a copy of each row (the general gather indexes every
    element)."""

    def rows(x: Array, indices: Array) -> Array:
        x, indices = np.asarray(x), np.asarray(indices)
        starts = indices.reshape(indices.shape[0])  # one index a row
        starts = np.clip(_as_int64(starts), 0, x.shape[0] - width)
        return np.lib.stride_tricks.sliding_window_view(x, width)[starts]

    return rows


def _call(block: _Block, op: ir.Operation) -> Fn:
    callee = block.planner.function(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
    if len(callee.results) == 1:  # its one result fills one slot
        return lambda *xs: callee(*xs)[0]
    return callee


_HANDLERS["func.call"] = _call


@_handles("convolution")
def _convolution(block: _Block, op: ir.Operation) -> Fn:
    attrs = op.attributes
    numbers = hlo.ConvDimensionNumbers(attrs["dimension_numbers"])
    groups = ir.IntegerAttr(attrs["feature_group_count"]).value
    if ir.IntegerAttr(attrs["batch_group_count"]).value != 1:
        raise Unsupported("a convolution with batch groups")
    if "window_reversal" in attrs and any(ir.DenseBoolArrayAttr(attrs["window_reversal"])):
        raise Unsupported("a convolution with window reversal")
    kernel_shape, _ = _tensor(op.operands[1])
    _, dtype = _result(op)
    spatial = len(numbers.input_spatial_dimensions)

    def optional(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
        return _ints(attrs[name]) if name in attrs else default

    strides = optional("window_strides", (1,) * spatial)
    lhs_dilation = optional("lhs_dilation", (1,) * spatial)
    rhs_dilation = optional("rhs_dilation", (1,) * spatial)
    flat_padding = optional("padding", (0,) * 2 * spatial)
    padding = list(zip(flat_padding[0::2], flat_padding[1::2], strict=True))
    to_nchw = [numbers.input_batch_dimension, numbers.input_feature_dimension]
    to_nchw += list(numbers.input_spatial_dimensions)
    to_oihw = [numbers.kernel_output_feature_dimension, numbers.kernel_input_feature_dimension]
    to_oihw += list(numbers.kernel_spatial_dimensions)
    out_order = [numbers.output_batch_dimension, numbers.output_feature_dimension]
    out_order += list(numbers.output_spatial_dimensions)
    from_nchw = list(np.argsort(out_order))
    window = [kernel_shape[d] for d in numbers.kernel_spatial_dimensions]
    terms = int(np.prod(window)) * kernel_shape[numbers.kernel_input_feature_dimension]
    floats = dtype.kind == "f"
    checked = floats and not _exact_as_planned(block, op, terms, dtype)

    def convolution(x: Array, k: Array) -> Array:
        x = np.asarray(x, dtype).transpose(to_nchw)
        k = np.asarray(k, dtype).transpose(to_oihw)
        if checked:
            _check_exact(terms, x, k)
        n, c = x.shape[:2]
        # lhs dilation, then padding (negative crops): the padded input the window slides on
        dilated = np.zeros(
            (
                n,
                c,
                *[
                    (s - 1) * d + 1 if s else 0
                    for s, d in zip(x.shape[2:], lhs_dilation, strict=True)
                ],
            ),
            dtype,
        )
        dilated[(slice(None), slice(None), *[slice(None, None, d) for d in lhs_dilation])] = x
        pads = [(0, 0), (0, 0)] + [(max(lo, 0), max(hi, 0)) for lo, hi in padding]
        padded = np.pad(dilated, pads)
        crop = [slice(None), slice(None)] + [
            slice(-min(lo, 0), size - (-min(hi, 0)))
            for size, (lo, hi) in zip(padded.shape[2:], padding, strict=True)
        ]
        padded = padded[tuple(crop)]
        out_sizes = [
            max(0, (size - ((w - 1) * d + 1)) // s + 1)
            for size, w, d, s in zip(padded.shape[2:], window, rhs_dilation, strides, strict=True)
        ]
        o = k.shape[0]
        grouped = padded.reshape(n, groups, c // groups, *padded.shape[2:])
        kernels = k.reshape(groups, o // groups, k.shape[1], *window)
        windows = [
            grouped[(slice(None), slice(None), slice(None), *taps)]
            for taps in (
                tuple(
                    slice(i * d, i * d + (size - 1) * s + 1, s)
                    for i, d, s, size in zip(offset, rhs_dilation, strides, out_sizes, strict=True)
                )
                for offset in np.ndindex(*window)
            )
        ]
        if windows[0].nbytes * len(windows) <= UNFOLD_LIMIT_BYTES:
            # all taps in one product (BLAS's, for floats; exact sums in any order)
            unfolded = np.stack(windows, axis=3)
            flat_kernels = kernels.reshape(*kernels.shape[:3], len(windows))
            out = np.einsum("ngck...,gock->ngo...", unfolded, flat_kernels, optimize=floats)
        else:
            out = np.zeros((n, groups, o // groups, *out_sizes), dtype)
            for offset, inputs in zip(np.ndindex(*window), windows, strict=True):
                out += np.einsum("ngc...,goc->ngo...", inputs, kernels[(Ellipsis, *offset)])
        return np.asarray(out, dtype).reshape(n, o, *out_sizes).transpose(from_nchw)

    return convolution
