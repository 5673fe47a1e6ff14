"""Fused tracing (`@mp.function(fuse=True)`): consecutive `run_jax` calls at one party set
become one PFunction, so a long chain of small ops costs one export and one compile.

Each call's output types come from `jax.eval_shape` at once; the segment is exported as a
whole when any other op is traced, a region opens, or the program ends.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
from jax.extend.core import jaxpr_as_fun

from mpplug.core import TensorType
from mpplug.core.graph import OpKind, ValueRef
from mpplug.core.parties import PartySet
from mpplug.errors import TraceError
from mpplug.frontend.jax_export import function_name, jax_export

if TYPE_CHECKING:
    from mpplug.frontend.tracer import GraphBuilder, TracedValue

_IN, _OUT = 0, 1


@dataclass
class Segment:
    """Calls fused so far at `parties`; their results are outputs of op `op_id` (the next
    op of the builder, appended when the segment is flushed)."""

    op_id: int
    parties: PartySet
    inputs: list[TracedValue] = field(default_factory=list)
    steps: list[tuple[Any, list[tuple[int, int]]]] = field(default_factory=list)
    """Each call: its closed jaxpr and where each of its inputs comes from."""
    x64: bool = False
    types: list[TensorType] = field(default_factory=list)
    produced: list[weakref.ref[TracedValue]] = field(default_factory=list)
    _input_index: dict[ValueRef, int] = field(default_factory=dict)

    def add(
        self, builder: GraphBuilder, fn: Callable[..., Any], leaves: list[Any], tree: Any
    ) -> Any:
        """Record `fn` on `leaves` (party values, or host values baked in); its outputs.

        The call is traced now, to a jaxpr with its constants and dtypes, so later changes
        (a loop variable, an array changed in place, the x64 setting) cannot reach it."""
        from mpplug.frontend.tracer import TracedValue

        sources: list[tuple[int, int]] = []
        avals = []
        static = list(leaves)
        dynamic = []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, TracedValue):
                continue
            dynamic.append(i)
            if leaf.ref.op == self.op_id:
                sources.append((_OUT, leaf.ref.index))
            else:
                index = self._input_index.setdefault(leaf.ref, len(self.inputs))
                if index == len(self.inputs):
                    self.inputs.append(leaf)
                sources.append((_IN, index))
            avals.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype.numpy))

        def call(*values: Any) -> Any:
            full = list(static)
            for i, value in zip(dynamic, values, strict=True):
                full[i] = value
            args, kwargs = jax.tree.unflatten(tree, full)
            return fn(*args, **kwargs)

        closed, out, x64 = _frozen(call, avals, function_name(fn))
        out_leaves, out_tree = jax.tree.flatten(out)
        try:
            types = [TensorType(o.dtype, o.shape) for o in out_leaves]
        except Exception as exc:
            raise TraceError(f"{function_name(fn)}: unsupported output: {exc}") from None
        first = len(self.types)
        self.types += types
        self.steps.append((closed, sources))
        self.x64 = self.x64 or x64
        values = [
            TracedValue(builder, ValueRef(self.op_id, first + k), t, self.parties)
            for k, t in enumerate(types)
        ]
        self.produced += [weakref.ref(v) for v in values]
        return jax.tree.unflatten(out_tree, values)

    def flush(self, builder: GraphBuilder) -> None:
        """Export the whole segment as one PFunction and append its CALL op. Its outputs are
        only the results still referenced (the rest can no longer be used), renumbered."""
        steps = list(self.steps)
        live = [(k, v) for k, ref in enumerate(self.produced) if (v := ref()) is not None]
        kept = [k for k, _ in live]

        def fused(*inputs: Any) -> tuple[Any, ...]:
            outs: list[Any] = []
            for closed, sources in steps:
                values = [inputs[v] if kind == _IN else outs[v] for kind, v in sources]
                outs += jaxpr_as_fun(closed)(*values)
            return tuple(outs[k] for k in kept)

        fused.__name__ = fused.__qualname__ = f"fused{len(steps)}"
        with jax.enable_x64(True) if self.x64 else contextlib.nullcontext():
            pfunc, _, _ = jax_export(fused, *self.inputs, platforms=builder.platforms)
        expected = tuple(self.types[k] for k in kept)
        if pfunc.outs_info != expected:
            raise TraceError(
                f"mp.function(fuse=True): the fused ops give "
                f"({', '.join(map(str, pfunc.outs_info))}) together but "
                f"({', '.join(map(str, expected))}) one by one (a 64-bit dtype asked for in "
                f"one op changes others' defaults); trace this program without fuse=True"
            )
        assert len(builder.ops) == self.op_id
        for index, (_, value) in enumerate(live):
            value.ref = ValueRef(self.op_id, index)
        builder.append_op(OpKind.CALL, self.parties, self.inputs, pfunc.outs_info, function=pfunc)


def _frozen(call: Callable[..., Any], avals: list[Any], name: str) -> tuple[Any, Any, bool]:
    """`call` traced to a closed jaxpr, its output shapes, and whether it needs x64, with
    64-bit types kept as `jax_export` keeps them."""
    x64 = bool(jax.config.read("jax_enable_x64")) or any(a.dtype.itemsize == 8 for a in avals)
    for attempt in (x64, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with jax.enable_x64(attempt):
                    closed, out = jax.make_jaxpr(call, return_shape=True)(*avals)
            except OverflowError:
                if attempt:
                    raise
                continue
        if attempt or not any("will be truncated" in str(w.message) for w in caught):
            return closed, out, attempt
    raise TraceError(f"{name}: could not determine its output types")  # pragma: no cover
