"""A share program's round as a `jax.exec` PFunction written straight from its equations:
StableHLO text, op for op what JAX's lowering rule gives, with no retrace and no lowering
(an op written twice is written once, ops the results do not need are left out, and a
broadcast one-element constant is a splat constant: what XLA would do to JAX's module).

The primitives share programs are made of (ring arithmetic, bits, compares, selects, slices,
reshapes, dots, convolutions, clamped gathers, reductions) emit here; an equation with any
other primitive or parameter raises `Unemittable`, and the caller exports that round with
`jax.export` instead.
The artifact is what `jax.export` makes of a function: a portable StableHLO module inside a
serialized `Exported`, every input kept, for one platform.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import export as jax_export
from jax import lax
from jax._src.interpreters import mlir as jax_mlir  # JAX's contexts, as its export parses in
from jax.extend.core import JaxprEqn, Literal, Var
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from mpplug.core import PFunction, TensorType
from mpplug.kernels import artifact, interpreted, jax_exec
from mpplug.kernels.runtime import DEFAULT_CACHE_SIZE, LRUCache
from mpplug.runtime.profile import phase

log = logging.getLogger(__name__)

ELEMENT_TYPES: dict[np.dtype, str] = {
    np.dtype(np.bool_): "i1",
    **{np.dtype(f"int{b}"): f"i{b}" for b in (8, 16, 32, 64)},
    **{np.dtype(f"uint{b}"): f"ui{b}" for b in (8, 16, 32, 64)},
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
}


class Unemittable(Exception):
    """An equation this module does not write: the round is exported by `jax.export`."""


class Value(NamedTuple):
    """An SSA value of the function being written (a tuple: a round writes tens of
    thousands of them)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def type(self) -> str:
        return _tensor_type(self.shape, self.dtype)


def tensor_type(shape: Sequence[int], dtype: Any) -> str:
    return _tensor_type(tuple(int(d) for d in shape), np.dtype(dtype))


@functools.lru_cache(maxsize=4096)
def _tensor_type(shape: tuple[int, ...], dtype: np.dtype) -> str:
    element = ELEMENT_TYPES.get(dtype)
    if element is None:
        raise Unemittable(f"element type {dtype}")
    return "tensor<" + "".join(f"{d}x" for d in shape) + element + ">"


def _i64s(values: Sequence[int]) -> str:
    return _i64s_of(tuple(map(int, values)))


@functools.lru_cache(maxsize=4096)
def _i64s_of(values: tuple[int, ...]) -> str:
    return "array<i64" + (": " + ", ".join(map(str, values)) if values else "") + ">"


def _dense(array: np.ndarray) -> str:
    if array.size > 64:
        return _dense_of(array)
    return _small_dense(array.dtype.str, array.shape, array.tobytes())


@functools.lru_cache(maxsize=4096)
def _small_dense(dtype: str, shape: tuple[int, ...], raw: bytes) -> str:
    """`_dense` of a small constant, by its bits (a round's shifts and masks come back in
    every round)."""
    return _dense_of(np.frombuffer(raw, dtype).reshape(shape))


def _dense_of(array: np.ndarray) -> str:
    if array.size == 0:
        raise Unemittable("an empty constant")
    flat = array.ravel()
    if array.dtype == np.bool_:
        if (flat == flat[0]).all():
            return "dense<true>" if flat[0] else "dense<false>"
        return (
            "dense<" + str(array.tolist()).replace("True", "true").replace("False", "false") + ">"
        )
    bits = flat.view(f"u{flat.dtype.itemsize}")
    data = flat[:1] if (bits == bits[0]).all() else flat  # one element: a splat
    raw = np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes()
    return f'dense<"0x{raw.hex().upper()}">'


class Builder:
    """Writes one `main` function; the methods mirror the `lax` calls a round's glue makes,
    so the same code drives JAX's tracer or this builder."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, tuple[str, ...], str]] = []
        """Each op written: (its result's name, its operands' names, its line)."""
        self.params: list[Value] = []
        self.count = 0
        self.constants: dict[tuple[Any, ...], Value] = {}
        self.scalars: dict[str, np.ndarray] = {}
        """The one-element constants, by name: broadcast, each is a splat constant."""
        self.written: dict[tuple[Any, ...], Value] = {}
        """Each op by what it computes: an op written twice is written once (ops are pure)."""
        self.reshaped: dict[str, Value] = {}
        """Each reshape's operand, by the reshape's name."""
        self.constant_names: set[str] = set()
        self.joined: dict[str, tuple[int, tuple[Value, ...]]] = {}
        """Each concatenate's axis and operands, by its name: a slice within one operand is
        a slice of that operand."""
        self.sliced: dict[str, tuple[Value, tuple[int, ...], tuple[int, ...]]] = {}
        """Each slice's operand, starts and strides, by its name: a slice of a slice is one
        slice of the first one's operand."""
        self.parts: dict[str, str] = {}
        """The op of each result of an op of several results (`%4#1`: `%4`), by its name."""

    # -- values

    def arg(self, shape: Sequence[int], dtype: Any) -> Value:
        value = Value(f"%arg{len(self.params)}", tuple(shape), np.dtype(dtype))
        value.type  # noqa: B018 - raises Unemittable for an element type not written here
        self.params.append(value)
        return value

    def value(self, x: Any, dtype: Any = None) -> Value:
        """`x` as a value: itself, or a constant (of `dtype`, where given)."""
        if isinstance(x, Value):
            return x
        array = np.asarray(x, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        found = self.constants.get(key)
        if found is None:
            found = self.constants[key] = self.op(
                "constant",
                [],
                array.shape,
                array.dtype,
                f"value = {_dense(array)} : {tensor_type(array.shape, array.dtype)}",
            )
            if array.size == 1:
                self.scalars[found.name] = array.reshape(1)
        return found

    def splat(self, scalar: np.ndarray, shape: tuple[int, ...]) -> Value:
        """A constant of `shape` whose every element is the one of `scalar`."""
        return self.op(
            "constant",
            [],
            shape,
            scalar.dtype,
            f"value = {_dense(scalar)} : {tensor_type(shape, scalar.dtype)}",
        )

    def op(
        self,
        kind: str,
        operands: Sequence[Value],
        shape: Sequence[int],
        dtype: Any,
        properties: str = "",
    ) -> Value:
        shape = shape if type(shape) is tuple else tuple(shape)
        dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        names = tuple([v.name for v in operands])
        key = (kind, names, shape, dtype, properties)
        found = self.written.get(key)
        if found is not None:
            return found
        self.count += 1
        name = f"%{self.count}"
        out = self.written[key] = Value(name, shape, dtype)
        if kind == "constant":
            self.constant_names.add(name)
        types = ", ".join([_tensor_type(v.shape, v.dtype) for v in operands])
        props = f" <{{{properties}}}>" if properties else ""
        self.lines.append(
            (
                name,
                names,
                f'    {name} = "stablehlo.{kind}"({", ".join(names)}){props} : ({types}) '
                f"-> {_tensor_type(shape, dtype)}",
            )
        )
        return out

    def name(self) -> str:
        """A fresh SSA name."""
        self.count += 1
        return f"%{self.count}"

    # -- what a round's glue calls (as `lax` does)

    def reshape(self, x: Any, shape: Sequence[int]) -> Value:
        x = self.value(x)
        x = self.reshaped.get(x.name, x)  # a reshape of a reshape: one reshape of its source
        if x.shape == tuple(shape):
            return x
        out = self.op("reshape", [x], shape, x.dtype)
        self.reshaped[out.name] = x
        return out

    def flat(self, x: Any) -> Value:
        x = self.value(x)
        return self.reshape(x, (math.prod(x.shape),))

    def slice(
        self,
        x: Any,
        start: Sequence[int],
        limit: Sequence[int],
        strides: Sequence[int] | None = None,
    ) -> Value:
        x = self.value(x)
        start, limit = tuple(map(int, start)), tuple(map(int, limit))
        steps = tuple(map(int, strides)) if strides is not None else (1,) * len(start)
        shape = tuple(-(-(hi - lo) // s) for lo, hi, s in zip(start, limit, steps, strict=True))
        if shape == x.shape:  # every element, in order
            return x
        inner = self.sliced.get(x.name) if 0 not in shape else None
        if inner is not None:  # a slice of a slice: one slice of the first one's operand
            source, first, by = inner
            start = tuple(f + s * b for f, s, b in zip(first, start, by, strict=True))
            steps = tuple(s * b for s, b in zip(steps, by, strict=True))
            limit = tuple(s + (n - 1) * t + 1 for s, n, t in zip(start, shape, steps, strict=True))
            return self.slice(source, start, limit, steps)
        joined = self.joined.get(x.name) if 0 not in shape else None
        if joined is not None:  # within one operand of a concatenate: a slice of that operand
            axis, operands = joined
            offset = 0
            for operand in operands:
                end = offset + operand.shape[axis]
                last = start[axis] + (shape[axis] - 1) * steps[axis]
                if offset <= start[axis] and last < end:
                    begin, stop = list(start), list(limit)
                    begin[axis], stop[axis] = start[axis] - offset, last - offset + 1
                    return self.slice(operand, begin, stop, steps)
                offset = end
        props = (
            f"start_indices = {_i64s(start)}, limit_indices = {_i64s(limit)}, "
            f"strides = {_i64s(steps)}"
        )
        out = self.op("slice", [x], shape, x.dtype, props)
        self.sliced[out.name] = (x, start, steps)
        return out

    def slice_in_dim(self, x: Any, start: int, limit: int) -> Value:
        x = self.value(x)
        starts, limits = [0] * len(x.shape), list(x.shape)
        starts[0], limits[0] = start, limit
        return self.slice(x, starts, limits)

    def concatenate(self, xs: Sequence[Any], dimension: int) -> Value:
        values = [self.value(x) for x in xs]
        shape = list(values[0].shape)
        shape[dimension] = sum(v.shape[dimension] for v in values)
        values = [v for v in values if v.shape[dimension]] or values[:1]  # empty ones add none
        if len(values) == 1:
            return values[0]
        out = self.op(
            "concatenate", values, shape, values[0].dtype, f"dimension = {dimension} : i64"
        )
        self.joined[out.name] = (dimension, tuple(values))
        return out

    def broadcast_in_dim(
        self, x: Value, shape: tuple[int, ...], dimensions: Sequence[int]
    ) -> Value:
        """`x` broadcast to `shape`, its axes at `dimensions`: a reshape where that only
        adds axes of one element (then a reshape of it is one reshape of `x`), a splat
        constant where `x` is a one-element constant."""
        dims = tuple(map(int, dimensions))
        if math.prod(shape) == math.prod(x.shape) and all(
            a < b for a, b in itertools.pairwise(dims)
        ):
            return self.reshape(x, shape)
        scalar = self.scalars.get(x.name)
        if scalar is not None:
            return self.splat(scalar, shape)
        props = f"broadcast_dimensions = {_i64s(dims)}"
        return self.op("broadcast_in_dim", [x], shape, x.dtype, props)

    def bitcast_convert_type(self, x: Any, dtype: Any) -> Value:
        """`x`'s bits as `dtype`, with `lax.bitcast_convert_type`'s shapes. Of a reshape, to
        words as wide or narrower: a reshape of its source's bits (each word's parts stay
        together in order), which a reshape after it folds into (a PRF stream read as
        narrower words: a row, its bits, the view's shape)."""
        x, dtype = self.value(x), np.dtype(dtype)
        shape = list(x.shape)
        if dtype.itemsize < x.dtype.itemsize:
            shape.append(x.dtype.itemsize // dtype.itemsize)
        elif dtype.itemsize > x.dtype.itemsize:
            shape.pop()
        source = self.reshaped.get(x.name)
        if source is not None and dtype.itemsize <= x.dtype.itemsize:
            return self.reshape(self.bitcast_convert_type(source, dtype), shape)
        return self.op("bitcast_convert", [x], shape, dtype)

    def convert_element_type(self, x: Any, dtype: Any) -> Value:
        x = self.value(x)
        dtype = np.dtype(dtype)
        if dtype == np.bool_ and x.dtype != np.bool_:
            zero = self.value(np.zeros(x.shape, x.dtype))
            return self.compare(x, zero, "NE")
        return x if dtype == x.dtype else self.op("convert", [x], x.shape, dtype)

    def clamp(self, low: Any, x: Any, high: Any) -> Value:
        x = self.value(x)
        operands = [self._broadcast(self.value(v, x.dtype), x.shape) for v in (low, x, high)]
        return self.op("clamp", operands, x.shape, x.dtype)

    def dynamic_slice(self, x: Any, starts: Sequence[Any], sizes: Sequence[int]) -> Value:
        x = self.value(x)
        indices = [self.value(s, np.int32) for s in starts]
        return self.op(
            "dynamic_slice", [x, *indices], sizes, x.dtype, f"slice_sizes = {_i64s(sizes)}"
        )

    def dynamic_slice_in_dim(self, x: Any, start: Any, size: int, axis: int = 0) -> Value:
        x = self.value(x)
        if isinstance(start, int):
            begin, end = [0] * len(x.shape), list(x.shape)
            begin[axis], end[axis] = start, start + size
            return self.slice(x, begin, end)
        starts: list[Any] = [np.int32(0)] * len(x.shape)
        starts[axis] = start
        sizes = list(x.shape)
        sizes[axis] = size
        return self.dynamic_slice(x, starts, sizes)

    def dynamic_index_in_dim(self, x: Any, index: Any, keepdims: bool = True) -> Value:
        x = self.value(x)
        picked = self.dynamic_slice_in_dim(x, index, 1, 0)
        return picked if keepdims else self.reshape(picked, x.shape[1:])

    def gather_rows(self, x: Any, starts: Any, width: int) -> Value:
        """Rows of `width` words of the vector `x` from each of `starts` (int32[rows, 1]),
        each start clamped into range, as `LAX.gather_rows` writes them."""
        x, starts = self.value(x), self.value(starts)
        props = (
            "dimension_numbers = #stablehlo.gather<offset_dims = [1], start_index_map = [0], "
            f"index_vector_dim = 1>, slice_sizes = {_i64s([width])}"
        )
        return self.op("gather", [x, starts], (starts.shape[0], width), x.dtype, props)

    def bitwise_or(self, x: Any, y: Any) -> Value:
        return self._elementwise("or", [x, y])

    def bitwise_and(self, x: Any, y: Any) -> Value:
        return self._elementwise("and", [x, y])

    def shift_left(self, x: Any, y: Any) -> Value:
        return self._elementwise("shift_left", [x, y])

    def compare(self, x: Value, y: Value, direction: str) -> Value:
        if np.issubdtype(x.dtype, np.floating):
            kind = "FLOAT"
        elif np.issubdtype(x.dtype, np.signedinteger):
            kind = "SIGNED"
        else:
            kind = "UNSIGNED"
        props = (
            f"comparison_direction = #stablehlo<comparison_direction {direction}>, "
            f"compare_type = #stablehlo<comparison_type {kind}>"
        )
        return self.op("compare", [x, y], x.shape, np.bool_, props)

    def reduce(self, kind: str, x: Value, axes: Sequence[int]) -> Value:
        """`x` reduced over `axes` by the binary op `kind`, from its identity."""
        init = self.value(_reduce_init(kind, x.dtype))
        scalar = tensor_type((), x.dtype)
        lhs, rhs, total = self.name(), self.name(), self.name()
        shape = tuple(n for axis, n in enumerate(x.shape) if axis not in axes)
        out = Value(self.name(), shape, x.dtype)
        lines = [
            f'    {out.name} = "stablehlo.reduce"({x.name}, {init.name}) '
            f"<{{dimensions = {_i64s(axes)}}}> ({{",
            f"    ^bb0({lhs}: {scalar}, {rhs}: {scalar}):",
            f'      {total} = "stablehlo.{kind}"({lhs}, {rhs}) : ({scalar}, {scalar}) -> {scalar}',
            f'      "stablehlo.return"({total}) : ({scalar}) -> ()',
            f"    }}) : ({x.type}, {init.type}) -> {out.type}",
        ]
        self.lines.append((out.name, (x.name, init.name), "\n".join(lines)))
        return out

    def results(
        self, name: str, line: str, operands: Sequence[Value], outs: Sequence[Value]
    ) -> list[Value]:
        """Write `line`, op `name` (from `name()`) of several results, reading `operands`:
        its results, of the types of `outs`, `name#0`, `name#1`..."""
        self.lines.append((name, tuple([v.name for v in operands]), line))
        parts = [Value(f"{name}#{i}", v.shape, v.dtype) for i, v in enumerate(outs)]
        self.parts.update(dict.fromkeys([v.name for v in parts], name))
        return parts

    # -- equations

    def bind(self, eqn: JaxprEqn, env: dict[Any, Any]) -> None:
        """Write `eqn` on the values of its inputs in `env`, and bind its outputs there."""
        rule = _RULES.get(eqn.primitive.name)
        if rule is None:
            raise Unemittable(f"primitive {eqn.primitive.name}")
        ins = [self._read(env, v) for v in eqn.invars]
        outs = rule(self, eqn, ins, env)
        for v, out in zip(eqn.outvars, outs, strict=True):
            if isinstance(v, Var) and not isinstance(v, Literal):
                env[v] = out

    def _read(self, env: dict[Any, Any], v: Any) -> Value:
        if isinstance(v, Literal):
            return self.value(np.asarray(v.val, dtype=v.aval.dtype))  # type: ignore[attr-defined]
        x = env[v]
        return x if isinstance(x, Value) else self.value(np.asarray(x, dtype=v.aval.dtype))

    def _broadcast(self, x: Value, shape: tuple[int, ...]) -> Value:
        if x.shape == shape:
            return x
        return self.broadcast_in_dim(x, shape, range(len(shape) - len(x.shape), len(shape)))

    def _elementwise(self, kind: str, operands: Sequence[Any], dtype: Any = None) -> Value:
        values = [self.value(v) for v in operands]
        shape = max((v.shape for v in values), key=len)
        values = [self._broadcast(v, shape) for v in values]
        return self.op(kind, values, shape, values[0].dtype if dtype is None else dtype)

    # -- the module

    def text(self, results: Sequence[Any]) -> str:
        """The module returning `results`, without the ops they do not depend on (a round's
        equations may compute what only another function needs, such as a PRF's key). Its
        constants come first, last written first, where JAX's writer would move them."""
        outs = [self.value(r) for r in results]
        parts = self.parts
        live = {parts.get(o.name, o.name) for o in outs}
        kept: list[str] = []
        constants: list[str] = []
        for name, operands, line in reversed(self.lines):
            if name in live:
                live.update([parts.get(o, o) for o in operands] if parts else operands)
                (constants if name in self.constant_names else kept).append(line)
        params = ", ".join(f"{p.name}: {p.type}" for p in self.params)
        types = ", ".join(o.type for o in outs)
        names = ", ".join(o.name for o in outs)
        return "\n".join(
            [
                "module @round attributes {jax.uses_shape_polymorphism = false, "
                "mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {",
                f"  func.func public @main({params}) -> ({types}) {{",
                *constants,
                *reversed(kept),
                f'    "func.return"({names}) : ({types}) -> ()',
                "  }",
                "}",
            ]
        )


Rule = Callable[[Builder, JaxprEqn, list[Value], dict[Any, Any]], list[Value]]


def _aval(eqn: JaxprEqn, i: int = 0) -> tuple[tuple[int, ...], np.dtype]:
    aval: Any = eqn.outvars[i].aval
    return tuple(aval.shape), np.dtype(aval.dtype)


def _no(eqn: JaxprEqn, *names: str) -> None:
    """Raise Unemittable unless each of `names` is absent or None among the params."""
    for name in names:
        if eqn.params.get(name) is not None:
            raise Unemittable(f"{eqn.primitive.name} with {name}={eqn.params[name]}")


def _elementwise(kind: str) -> Rule:
    def rule(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
        _no(eqn, "out_dtype", "accuracy")
        shape, dtype = _aval(eqn)
        return [b.op(kind, [b._broadcast(x, shape) for x in ins], shape, dtype)]

    return rule


def _sign(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    shape, dtype = _aval(eqn)
    if np.issubdtype(dtype, np.unsignedinteger):  # JAX writes a select there
        raise Unemittable(f"sign of {dtype}")
    return [b.op("sign", ins, shape, dtype)]


def _compare(direction: str) -> Rule:
    def rule(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
        shape, _ = _aval(eqn)
        x, y = (b._broadcast(v, shape) for v in ins)
        return [b.compare(x, y, direction)]

    return rule


def _select_n(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    which, *cases = ins
    shape, dtype = _aval(eqn)
    if which.dtype == np.bool_:
        if len(cases) == 1:
            return cases
        return [b.op("select", [which, cases[1], cases[0]], shape, dtype)]

    def pick(offset: int, cases: list[Value]) -> Value:  # as JAX: a tree of compares
        if len(cases) == 1:
            return cases[0]
        mid = len(cases) // 2
        bound = b.value(np.full(which.shape, offset + mid, which.dtype))
        low = b.compare(which, bound, "LT")
        return b.op(
            "select",
            [low, pick(offset, cases[:mid]), pick(offset + mid, cases[mid:])],
            shape,
            dtype,
        )

    return [pick(0, cases)]


def _convert(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    _no(eqn, "sharding")
    return [b.convert_element_type(ins[0], eqn.params["new_dtype"])]


def _reshape(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    _no(eqn, "dimensions", "sharding")
    return [b.reshape(ins[0], _aval(eqn)[0])]


def _broadcast_in_dim(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    _no(eqn, "sharding")
    return [b.broadcast_in_dim(ins[0], _aval(eqn)[0], eqn.params["broadcast_dimensions"])]


def _slice(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    p = eqn.params
    return [b.slice(ins[0], p["start_indices"], p["limit_indices"], p["strides"])]


def _dynamic_slice(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    x, *starts = ins
    return [b.dynamic_slice(x, starts, eqn.params["slice_sizes"])]


def _dynamic_update_slice(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    shape, dtype = _aval(eqn)
    return [b.op("dynamic_update_slice", ins, shape, dtype)]


def _concatenate(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    return [b.concatenate(ins, eqn.params["dimension"])]


def _stack(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    """Each part given an axis of one element, then concatenated: an unstack of it in the
    same function is its very parts (see `Builder.slice` and `Builder.reshape`)."""
    axis = eqn.params["axis"]
    shape = list(ins[0].shape)
    shape.insert(axis, 1)
    dims = [i for i in range(len(shape)) if i != axis]
    return [b.concatenate([b.broadcast_in_dim(x, tuple(shape), dims) for x in ins], axis)]


def _unstack(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    (x,), axis = ins, eqn.params["axis"]
    shape = [d for i, d in enumerate(x.shape) if i != axis]
    outs = []
    for i in range(x.shape[axis]):
        start, limit = [0] * len(x.shape), list(x.shape)
        start[axis], limit[axis] = i, i + 1
        outs.append(b.reshape(b.slice(x, start, limit), shape))
    return outs


def _transpose(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    shape, dtype = _aval(eqn)
    perm = _i64s(eqn.params["permutation"])
    return [b.op("transpose", ins, shape, dtype, f"permutation = {perm}")]


def _rev(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    shape, dtype = _aval(eqn)
    return [b.op("reverse", ins, shape, dtype, f"dimensions = {_i64s(eqn.params['dimensions'])}")]


def _iota(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    _no(eqn, "sharding")
    shape, dtype = _aval(eqn)
    return [b.op("iota", [], shape, dtype, f"iota_dimension = {eqn.params['dimension']} : i64")]


def _pad(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    shape, dtype = _aval(eqn)
    low, high, interior = zip(*eqn.params["padding_config"], strict=True)
    props = (
        f"edge_padding_low = {_i64s(low)}, edge_padding_high = {_i64s(high)}, "
        f"interior_padding = {_i64s(interior)}"
    )
    return [b.op("pad", ins, shape, dtype, props)]


def _round(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    method = eqn.params["rounding_method"]
    kind = "round_nearest_afz" if int(method) == 0 else "round_nearest_even"
    return [b.op(kind, ins, *_aval(eqn))]


def _reduce_init(kind: str, dtype: np.dtype) -> np.ndarray:
    """The identity of a reduction, as JAX's lowering picks it."""
    if kind in ("add", "or", "xor"):
        return np.zeros((), dtype)
    if kind == "and":
        return ~np.zeros((), dtype)
    high = kind == "minimum"
    if np.issubdtype(dtype, np.floating):
        return np.array(np.inf if high else -np.inf, dtype)
    if dtype == np.bool_:
        return np.array(high)
    info = np.iinfo(dtype)
    return np.array(info.max if high else info.min, dtype)


def _reduce(kind: str) -> Rule:
    def rule(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
        _no(eqn, "out_sharding")
        return [b.reduce(kind, ins[0], eqn.params["axes"])]

    return rule


def _dot_general(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    _no(eqn, "out_sharding")
    shape, dtype = _aval(eqn)
    preferred = eqn.params.get("preferred_element_type")
    if dtype == np.bool_ or any(x.dtype != dtype for x in ins):
        raise Unemittable(f"dot_general of {[x.dtype for x in ins]} to {dtype}")
    if preferred is not None and np.dtype(preferred) != dtype:
        raise Unemittable(f"dot_general accumulating in {preferred}")
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    fields = [
        f"{name} = [{', '.join(map(str, dims))}]"
        for name, dims in (
            ("lhs_batching_dimensions", lb),
            ("rhs_batching_dimensions", rb),
            ("lhs_contracting_dimensions", lc),
            ("rhs_contracting_dimensions", rc),
        )
        if dims
    ]
    props = f"dot_dimension_numbers = #stablehlo.dot<{', '.join(fields)}>"
    return [b.op("dot_general", ins, shape, dtype, props + _precision(eqn))]


def _precision(eqn: JaxprEqn) -> str:
    """A product's precision config as JAX writes it (the same on every platform)."""
    precision = eqn.params.get("precision")
    if precision is None:
        precision = (lax.Precision.DEFAULT,) * 2
    elif isinstance(precision, lax.Precision):
        precision = (precision,) * 2
    if not isinstance(precision, tuple) or any(not isinstance(p, lax.Precision) for p in precision):
        raise Unemittable(f"{eqn.primitive.name} with precision={precision}")  # an algorithm
    names = ", ".join(f"#stablehlo<precision {p.name}>" for p in precision)
    return f", precision_config = [{names}]"


def _conv_layout(spec: Sequence[int], first: str, second: str) -> str:
    """`spec` (the positions of the two named dimensions, then the spatial ones) as StableHLO
    writes a layout: [b, 0, 1, f] for NHWC inputs."""
    names = [""] * len(spec)
    names[spec[0]], names[spec[1]] = first, second
    for i, dim in enumerate(spec[2:]):
        names[dim] = str(i)
    return "[" + ", ".join(names) + "]"


def _convolution(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    _no(eqn, "out_sharding")
    shape, dtype = _aval(eqn)
    p = eqn.params
    preferred = p.get("preferred_element_type")
    if dtype == np.bool_ or any(x.dtype != dtype for x in ins):
        raise Unemittable(f"conv_general_dilated of {[x.dtype for x in ins]} to {dtype}")
    if (preferred is not None and np.dtype(preferred) != dtype) or not p["padding"]:
        raise Unemittable(f"conv_general_dilated with {preferred=} and {p['padding']=}")
    lhs, rhs, out = p["dimension_numbers"]
    layouts = (
        f"{_conv_layout(lhs, 'b', 'f')}x{_conv_layout(rhs, 'o', 'i')}->"
        f"{_conv_layout(out, 'b', 'f')}"
    )
    pads = ", ".join(f"[{lo}, {hi}]" for lo, hi in p["padding"])
    props = (
        f"batch_group_count = {p['batch_group_count']} : i64, "
        f"dimension_numbers = #stablehlo.conv<{layouts}>, "
        f"feature_group_count = {p['feature_group_count']} : i64, "
        f"lhs_dilation = {_i64s(p['lhs_dilation'])}, "
        f"padding = dense<[{pads}]> : tensor<{len(p['padding'])}x2xi64>, "
        f"rhs_dilation = {_i64s(p['rhs_dilation'])}, "
        f"window_strides = {_i64s(p['window_strides'])}"
    )
    return [b.op("convolution", ins, shape, dtype, props + _precision(eqn))]


def _gather(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    """A gather whose indices are clamped into range (JAX's clip and promise-in-bounds
    modes), or in fill mode (`_gather_filled`)."""
    p = eqn.params
    if p["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        return _gather_filled(b, eqn, ins, env)
    if p["mode"] not in (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS):
        raise Unemittable(f"gather in mode {p['mode']}")
    return [_gather_op(b, p, ins, *_aval(eqn))]


def _dimension_numbers(kind: str, index_vector_dim: int, **dims: Sequence[int]) -> str:
    """A gather's or a scatter's dimension numbers attribute (empty lists left out)."""
    fields = [f"{name} = [{', '.join(map(str, d))}]" for name, d in dims.items() if d]
    fields.append(f"index_vector_dim = {index_vector_dim}")
    return f"#stablehlo.{kind}<{', '.join(fields)}>"


def _gather_op(
    b: Builder, p: dict[str, Any], ins: list[Value], shape: tuple[int, ...], dtype: np.dtype
) -> Value:
    numbers = p["dimension_numbers"]
    gather = _dimension_numbers(
        "gather",
        len(ins[1].shape) - 1,
        offset_dims=numbers.offset_dims,
        collapsed_slice_dims=numbers.collapsed_slice_dims,
        operand_batching_dims=numbers.operand_batching_dims,
        start_indices_batching_dims=numbers.start_indices_batching_dims,
        start_index_map=numbers.start_index_map,
    )
    props = f"dimension_numbers = {gather}, "
    if p["indices_are_sorted"]:
        props += "indices_are_sorted = true, "
    props += f"slice_sizes = {_i64s(p['slice_sizes'])}"
    return b.op("gather", ins, shape, dtype, props)


def _gather_filled(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    """A gather in fill mode, as JAX lowers one: an in-bounds gather, each row whose start
    is out of range (below 0, or past the operand's size less the slice's) the fill value."""
    p = eqn.params
    if p["fill_value"] is None:
        raise Unemittable("gather in fill mode without a fill value")
    operand, indices = ins
    numbers = p["dimension_numbers"]
    shape, dtype = _aval(eqn)
    index = np.dtype(np.int64 if max(operand.shape, default=0) > 2**31 - 1 else np.int32)
    indices = b.convert_element_type(indices, index)
    upper = [operand.shape[d] - p["slice_sizes"][d] for d in numbers.start_index_map]
    batch = len(indices.shape) - 1
    inside = b.bitwise_and(
        b.compare(indices, b.splat(np.zeros((), index), indices.shape), "GE"),
        b.compare(indices, b.value(np.broadcast_to(np.array(upper, index), indices.shape)), "LE"),
    )
    rows = b.reduce("and", inside, (batch,))
    kept = [axis for axis in range(len(shape)) if axis not in numbers.offset_dims]
    mask = b.broadcast_in_dim(rows, shape, kept)
    gathered = _gather_op(b, p, [operand, indices], shape, dtype)
    fill = b.splat(np.asarray(p["fill_value"], dtype), shape)
    return [b.op("select", [mask, gathered, fill], shape, dtype)]


def _sort(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    """A sort by one integer key (JAX's comparator for one: a LT of the key's two
    elements); a float key's total order is exported instead."""
    p = eqn.params
    key = ins[0]
    if p["num_keys"] != 1 or key.dtype.kind not in "iu":
        raise Unemittable(f"sort by {p['num_keys']} keys of {key.dtype}")
    kind = "SIGNED" if key.dtype.kind == "i" else "UNSIGNED"
    scalars = [tensor_type((), v.dtype) for v in ins]
    name, args = b.name(), [b.name() for _ in range(2 * len(ins))]
    less = b.name()
    types = ", ".join(v.type for v in ins)
    lines = [
        f'    {name}:{len(ins)} = "stablehlo.sort"({", ".join(v.name for v in ins)}) '
        f"<{{dimension = {p['dimension']} : i64, is_stable = {str(p['is_stable']).lower()}}}> ({{",
        "    ^bb0(" + ", ".join(f"{a}: {scalars[i // 2]}" for i, a in enumerate(args)) + "):",
        f'      {less} = "stablehlo.compare"({args[0]}, {args[1]}) <{{comparison_direction = '
        f"#stablehlo<comparison_direction LT>, compare_type = #stablehlo<comparison_type "
        f"{kind}>}}> : ({scalars[0]}, {scalars[0]}) -> tensor<i1>",
        f'      "stablehlo.return"({less}) : (tensor<i1>) -> ()',
        f"    }}) : ({types}) -> ({types})",
    ]
    return b.results(name, "\n".join(lines), ins, ins)


def _scatter(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    """A scatter that puts updates in place (`x.at[i].set(u)`) with out-of-range ones
    dropped, as XLA's scatter drops them (JAX's fill and promise-in-bounds modes)."""
    p = eqn.params
    if p["mode"] == lax.GatherScatterMode.CLIP:
        raise Unemittable(f"scatter in mode {p['mode']}")
    if p["update_jaxpr"] is not None:
        raise Unemittable("scatter with an update function")
    operand, indices, updates = ins
    numbers = p["dimension_numbers"]
    scatter = _dimension_numbers(
        "scatter",
        len(indices.shape) - 1,
        update_window_dims=numbers.update_window_dims,
        inserted_window_dims=numbers.inserted_window_dims,
        input_batching_dims=numbers.operand_batching_dims,
        scatter_indices_batching_dims=numbers.scatter_indices_batching_dims,
        scatter_dims_to_operand_dims=numbers.scatter_dims_to_operand_dims,
    )
    scalar = tensor_type((), operand.dtype)
    out = Value(b.name(), operand.shape, operand.dtype)
    old, new = b.name(), b.name()
    lines = [
        f'    {out.name} = "stablehlo.scatter"({operand.name}, {indices.name}, {updates.name}) '
        f"<{{indices_are_sorted = {str(p['indices_are_sorted']).lower()}, "
        f"scatter_dimension_numbers = {scatter}, "
        f"unique_indices = {str(p['unique_indices']).lower()}}}> ({{",
        f"    ^bb0({old}: {scalar}, {new}: {scalar}):",
        f'      "stablehlo.return"({new}) : ({scalar}) -> ()',
        f"    }}) : ({operand.type}, {indices.type}, {updates.type}) -> {out.type}",
    ]
    b.lines.append((out.name, (operand.name, indices.name, updates.name), "\n".join(lines)))
    return [out]


def _inline(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    closed = eqn.params["jaxpr"]
    inner: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    inner.update(zip(closed.jaxpr.invars, ins, strict=True))
    for e in closed.jaxpr.eqns:
        b.bind(e, inner)
    return [b._read(inner, v) for v in closed.jaxpr.outvars]


def _copy(b: Builder, eqn: JaxprEqn, ins: list[Value], env: Any) -> list[Value]:
    return ins


_RULES: dict[str, Rule] = {
    **{
        name: _elementwise(kind)
        for name, kind in {
            "add": "add",
            "add_any": "add",
            "sub": "subtract",
            "mul": "multiply",
            "div": "divide",
            "rem": "remainder",
            "and": "and",
            "or": "or",
            "xor": "xor",
            "not": "not",
            "neg": "negate",
            "abs": "abs",
            "max": "maximum",
            "min": "minimum",
            "shift_left": "shift_left",
            "shift_right_logical": "shift_right_logical",
            "shift_right_arithmetic": "shift_right_arithmetic",
            "population_count": "popcnt",
            "floor": "floor",
            "ceil": "ceil",
            "clamp": "clamp",
        }.items()
    },
    **{name: _compare(name.upper()) for name in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{
        f"reduce_{name}": _reduce(kind)
        for name, kind in {
            "sum": "add",
            "max": "maximum",
            "min": "minimum",
            "and": "and",
            "or": "or",
            "xor": "xor",
        }.items()
    },
    "select_n": _select_n,
    "sign": _sign,
    "convert_element_type": _convert,
    "bitcast_convert_type": lambda b, e, ins, env: [
        b.bitcast_convert_type(ins[0], e.params["new_dtype"])
    ],
    "reshape": _reshape,
    "squeeze": lambda b, e, ins, env: [b.reshape(ins[0], _aval(e)[0])],
    "broadcast_in_dim": _broadcast_in_dim,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "concatenate": _concatenate,
    "stack": _stack,
    "unstack": _unstack,
    "transpose": _transpose,
    "rev": _rev,
    "iota": _iota,
    "pad": _pad,
    "round": _round,
    "dot_general": _dot_general,
    "conv_general_dilated": _convolution,
    "gather": _gather,
    "sort": _sort,
    "scatter": _scatter,
    "jit": _inline,
    "pjit": _inline,
    "copy": _copy,
    "copy_p": _copy,
}


# -- the artifact


@functools.cache
def _target_version() -> str:
    return str(
        hlo.get_version_from_compatibility_requirement(hlo.StablehloCompatibilityRequirement.WEEK_4)
    )


CONTEXT_USES = 256
"""Modules a thread parses in one MLIR context before it starts a new one (a context keeps
the constants it parsed until it is dropped)."""

_contexts = threading.local()


def _context() -> ir.Context:
    """This thread's MLIR context, a new one every `CONTEXT_USES` modules."""
    context = getattr(_contexts, "context", None)
    if context is None or _contexts.uses >= CONTEXT_USES:
        context = _contexts.context = jax_mlir.make_ir_context()
        _contexts.uses = 0
    _contexts.uses += 1
    return context


def evaluated(eqn: JaxprEqn, values: Sequence[Any]) -> list[np.ndarray] | None:
    """`eqn` on the concrete `values` of its inputs (a literal's too), with the bits XLA
    gives, run as an interpreted plan: JAX compiles each primitive it runs on concrete
    values (about 30 ms a primitive and signature on a CPU). None where a plan cannot give
    them (then the caller binds the primitive)."""
    if any(getattr(v.aval, "weak_type", False) for v in eqn.outvars):
        return None  # JAX's result is weakly typed, a numpy array is not
    builder = Builder()
    env: dict[Any, Any] = {}
    arrays = []
    try:
        for v, value in zip(eqn.invars, values, strict=True):
            if not isinstance(v, Literal):
                array = np.asarray(value, dtype=v.aval.dtype)  # type: ignore[attr-defined]
                env[v] = builder.arg(array.shape, array.dtype)
                arrays.append(array)
        builder.bind(eqn, env)
        outs = [builder.value(env[v]) for v in eqn.outvars]
        plan = _plan_of(builder.text(outs))
        if plan is None:
            return None
        got = interpreted.call(plan, arrays)
    except (Unemittable, interpreted.NotExact):
        return None
    except Exception as exc:  # what a rule did not foresee: JAX binds it, as it always could
        log.debug("%s on constants: bound by JAX (%s: %s)", eqn.primitive, type(exc).__name__, exc)
        return None
    return [
        np.asarray(x, dtype=v.aval.dtype)  # type: ignore[attr-defined]
        for x, v in zip(got, eqn.outvars, strict=True)
    ]


CONSTANT_PLANS_BYTES = 16 << 20
_CONSTANT_PLANS: LRUCache[str, interpreted.Plan | None] = LRUCache(
    DEFAULT_CACHE_SIZE,
    weigh=lambda plan: plan.weight if plan is not None else 1,
    max_weight=CONSTANT_PLANS_BYTES,
)
"""The plans of public constants' one-op modules, by module text (an unrolled loop of public
math repeats the same few), weighed by what they hold (16 MiB in all)."""


def _plan_of(text: str) -> interpreted.Plan | None:
    return _CONSTANT_PLANS.get_or_create(text, lambda: _parsed_plan(text))


def _parsed_plan(text: str) -> interpreted.Plan | None:
    with _context():
        try:
            return _plan(ir.Module.parse(text))
        except Exception:  # a module the parser refuses: bound by JAX instead
            return None


def _serialized(text: str, planned: bool) -> tuple[bytes, interpreted.Plan | None]:
    """The module `text` as a portable artifact whose bytes JAX's writer gives back
    unchanged (a party's module check parses and writes each module again), and, if
    `planned`, its interpreted plan (None where a plan cannot run it), made from the module
    parsed here before writing it turns it into VHLO.

    JAX's writer runs its legalization passes first (CHLO, MHLO, shapes), which change
    nothing in a module of StableHLO ops but hoist its constants to the top of `main` (see
    `Builder.text`), and verify the module after each one: StableHLO's own writer, used
    here, takes a third of the time."""
    with _context():
        with phase("mpc round parsed"):
            try:
                module = ir.Module.parse(text)
            except Exception as exc:  # a module the parser refuses: JAX's export writes it
                raise Unemittable(f"the module does not parse: {exc}") from None
        if planned:
            with phase("mpc round planned"):
                plan = _plan(module)
        else:
            plan = None
        with phase("mpc round serialized"):
            return bytes(hlo.serialize_portable_artifact(module, _target_version())), plan


def _plan(module: ir.Module) -> interpreted.Plan | None:
    try:
        return interpreted.plan(module)
    except interpreted.Unsupported:  # planned again from the artifact, which says why
        return None


def jaxpr_function(
    name: str, closed: jax.extend.core.ClosedJaxpr, platforms: Sequence[str] | None
) -> PFunction:
    """The PFunction of a closed jaxpr: its inputs and results, each equation written by a
    `Builder` (raises Unemittable as `round_function` does)."""
    jaxpr = closed.jaxpr
    inputs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]

    def body(ops: Any, *values: Any) -> list[Any]:  # ops: a Builder, or what stands for one
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, values, strict=True))
        for eqn in jaxpr.eqns:
            ops.bind(eqn, env)
        return [
            np.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env[v]  # type: ignore[attr-defined]
            for v in jaxpr.outvars
        ]

    return round_function(name, inputs, body, platforms)


WRITTEN_BYTES = 64 << 20
_WRITTEN: LRUCache[tuple[Any, ...], PFunction] = LRUCache(
    4 * DEFAULT_CACHE_SIZE, weigh=lambda p: len(p.fn_body), max_weight=WRITTEN_BYTES
)
"""Rounds this process wrote, by their module text, name, types and platform: a round written
again (by the next program, or a program traced anew after an edit) is not parsed and
written again (about 1 ms)."""


def round_function(
    name: str,
    inputs: Sequence[jax.ShapeDtypeStruct],
    body: Callable[..., Sequence[Any]],
    platforms: Sequence[str] | None,
) -> PFunction:
    """The PFunction of `body(builder, *inputs)` (which returns its results), written by a
    `Builder`; raises Unemittable where the body meets what it does not write."""
    if platforms is not None and len(platforms) != 1:
        raise Unemittable("several platforms")
    platform = platforms[0] if platforms else jax.default_backend()
    builder = Builder()
    args = [builder.arg(s.shape, s.dtype) for s in inputs]
    results = [builder.value(r) for r in body(builder, *args)]
    text = builder.text(results)
    in_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in inputs)
    out_avals = tuple(jax.core.ShapedArray(r.shape, r.dtype) for r in results)
    key = (hashlib.sha256(text.encode()).digest(), name, platform, in_avals, out_avals)
    return _WRITTEN.get_or_create(key, lambda: _written(name, platform, text, in_avals, out_avals))


def _written(
    name: str,
    platform: str,
    text: str,
    in_avals: tuple[jax.core.ShapedArray, ...],
    out_avals: tuple[jax.core.ShapedArray, ...],
) -> PFunction:
    module, plan = _serialized(text, jax_exec.plans_written())
    with phase("mpc round exported"):
        return _pfunction(name, platform, module, plan, in_avals, out_avals)


def _pfunction(
    name: str,
    platform: str,
    module: bytes,
    plan: interpreted.Plan | None,
    in_avals: tuple[jax.core.ShapedArray, ...],
    out_avals: tuple[jax.core.ShapedArray, ...],
) -> PFunction:
    """The PFunction of a round's serialized `module`: its `jax.export` artifact."""
    n, m = len(in_avals), len(out_avals)
    exported = jax_export.Exported(
        fun_name=name,
        in_tree=jax.tree.structure((tuple(range(n)), {})),
        in_avals=in_avals,
        out_tree=jax.tree.structure(tuple(range(m))),
        out_avals=out_avals,
        _has_named_shardings=True,
        _in_named_shardings=(None,) * n,
        _out_named_shardings=(None,) * m,
        in_shardings_hlo=(None,) * n,
        out_shardings_hlo=(None,) * m,
        nr_devices=1,
        platforms=(platform,),
        ordered_effects=(),
        unordered_effects=(),
        disabled_safety_checks=(),
        mlir_module_serialized=module,
        calling_convention_version=jax.config.jax_export_calling_convention_version,  # type: ignore[attr-defined]
        module_kept_var_idx=tuple(range(n)),
        uses_global_constants=False,
        _get_vjp=None,
    )
    attrs = {
        jax_exec.ATTR_JAX_VERSION: jax.__version__,
        jax_exec.ATTR_CALLING_CONVENTION: exported.calling_convention_version,
        jax_exec.ATTR_PLATFORMS: tuple(exported.platforms),
        jax_exec.ATTR_KEPT_INPUTS: tuple(range(n)),
        jax_exec.ATTR_X64: True,
    }
    pfunc = PFunction(
        jax_exec.FN_TYPE,
        name,
        artifact.serialize(exported),
        tuple(TensorType(a.dtype, a.shape) for a in in_avals),
        tuple(TensorType(a.dtype, a.shape) for a in out_avals),
        attrs,
    )
    jax_exec.written_here(pfunc, exported, plan)
    return pfunc
