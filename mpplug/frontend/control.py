"""Control flow inside programs: `cond`, `while_loop` and `fori_loop` trace their functions
into regions of one COND or WHILE op, which every party taking part runs locally."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.tree_util import keystr

from mpplug.core.graph import OpKind, Region, ValueRef, participants
from mpplug.core.mpobject import MPObject
from mpplug.core.parties import PartySet, format_parties
from mpplug.core.validate import PREDICATE
from mpplug.errors import TraceError
from mpplug.frontend.jax_export import function_name
from mpplug.frontend.primitives import constant, run_pfunc
from mpplug.frontend.tracer import GraphBuilder, TracedValue, current_builder, tracing
from mpplug.kernels import builtin

INDEX_LIMIT = 2**31 - 1


def _party_leaves(builder: GraphBuilder, tree: Any, where: str) -> tuple[list[TracedValue], Any]:
    """The leaves of `tree` as values of `builder` (each must be a party value)."""
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    values = []
    for path, leaf in paths_leaves:
        if not isinstance(leaf, MPObject):
            raise TraceError(
                f"{where}{keystr(path)} is {type(leaf).__name__}, expected a party value; "
                f"place constants with mp.constant(value, parties=...)"
            )
        values.append(builder.value(leaf, f"{where}{keystr(path)}"))
    return values, treedef


def _trace_region(
    builder: GraphBuilder,
    name: str,
    fn: Callable[..., Any],
    operands: Sequence[TracedValue],
    rebuild: Callable[[list[TracedValue]], tuple[Any, ...]],
) -> tuple[GraphBuilder, Any]:
    """Trace `fn(*rebuild(params))` into a new region whose first parameters are `operands`."""
    region = builder.region(name)
    params = [region.param(v) for v in operands]
    with tracing(region):
        result = fn(*rebuild(params))
        jax.tree.leaves(result)  # a pytree that adds ops as it leaves (mp.mpc.Sealed): here
    return region, result


def _describe(v: TracedValue) -> str:
    return f"{v.type} @{format_parties(v.parties)}"


def _check_same(
    where: str,
    names: tuple[str, str],
    trees: tuple[Any, Any],
    leaves: tuple[list[TracedValue], ...],
) -> None:
    """Two traced outputs must agree in structure, types and placements."""
    (a, b), (ta, tb) = names, trees
    if ta != tb:
        raise TraceError(f"{where}: {a} gives {ta}, but {b} gives {tb}")
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ta.unflatten(leaves[0]))[0]]
    for path, x, y in zip(paths, *leaves, strict=True):
        if (x.type, x.parties) != (y.type, y.parties):
            raise TraceError(
                f"{where}: output{path} is {_describe(x)} from {a}, but {_describe(y)} from {b}"
            )


def _unify(regions: Sequence[GraphBuilder], explicit: Sequence[TracedValue]) -> list[TracedValue]:
    """Give every region the same parameters: the explicit operands, then every value any of
    them captured from the enclosing builder."""
    combined = list(explicit)
    seen: set[int] = set()
    for region in regions:
        for v in region.operands[len(explicit) :]:
            if id(v) not in seen:
                seen.add(id(v))
                combined.append(v)
    for region in regions:
        region.bind_operands(combined, len(explicit))
    return combined


def _check_predicate_holders(
    where: str, holders: PartySet, taking_part: PartySet, what: str, hint: str
) -> None:
    missing = taking_part - holders
    if missing:
        raise TraceError(
            f"{where}: parties {format_parties(missing)} take part but do not hold {what} "
            f"(held by {format_parties(holders)}); {hint}"
        )


def cond(
    pred: MPObject, true_fn: Callable[..., Any], false_fn: Callable[..., Any], *operands: Any
) -> Any:
    """`true_fn(*operands)` where `pred` is true, else `false_fn(*operands)`, at every party
    taking part in either branch.

    `pred` is a bool[] held by every such party, with the same value at each (a broadcast or
    revealed value). Both branches may use every primitive and must return the same
    structure of party values with the same types and placements.
    """
    builder = current_builder("cond")
    where = "mp.cond"
    predicate = builder.value(pred, f"{where} predicate")
    if predicate.type != PREDICATE:
        raise TraceError(
            f"{where}: expected a {PREDICATE} predicate, got {predicate.type}; compare first, "
            f"e.g. mp.run_jax(lambda x: x > 0, x)"
        )
    values, in_tree = _party_leaves(builder, operands, f"{where} operand")
    branches = []
    for name, fn in (("true", true_fn), ("false", false_fn)):
        region, result = _trace_region(
            builder, name, fn, values, lambda params: jax.tree.unflatten(in_tree, params)
        )
        outs, out_tree = _party_leaves(
            region, result, f"{where}: {name}_fn {function_name(fn)} output"
        )
        branches.append((region, outs, out_tree))
    (true_region, true_outs, true_tree), (false_region, false_outs, false_tree) = branches
    _check_same(
        where,
        (f"true_fn {function_name(true_fn)}", f"false_fn {function_name(false_fn)}"),
        (true_tree, false_tree),
        (true_outs, false_outs),
    )
    combined = _unify([true_region, false_region], values)
    out_parties = [v.parties for v in true_outs]
    taking_part = participants(true_region.build_region(true_outs))
    taking_part |= participants(false_region.build_region(false_outs))
    taking_part |= frozenset().union(*out_parties)
    if not taking_part:
        return true_tree.unflatten([])
    _check_predicate_holders(
        where,
        predicate.parties,
        taking_part,
        "the predicate",
        f"send it to them first, e.g. pred = mp.bcast({min(predicate.parties)}, pred)",
    )
    results = builder.add_op(
        OpKind.COND,
        taking_part,
        [predicate, *combined],
        [v.type for v in true_outs],
        regions=(true_region.build_region(true_outs), false_region.build_region(false_outs)),
        out_parties=out_parties,
    )
    return true_tree.unflatten(results)


def while_loop(cond_fn: Callable[[Any], Any], body_fn: Callable[[Any], Any], init: Any) -> Any:
    """Run `body_fn` on the loop-carried pytree while `cond_fn` of it is true; inside the
    parties, with no round trip to the driver per iteration.

    Every leaf of `init` is a party value; `body_fn` returns the same structure, types and
    placements. `cond_fn` returns a bool[] held, with one value, by every party taking part
    in the loop (broadcast it inside `cond_fn` when one party decides).
    """
    builder = current_builder("while_loop")
    where = "mp.while_loop"
    carried, tree = _party_leaves(builder, init, f"{where} init")
    if not carried:
        raise TraceError(f"{where}: expected at least one party value in init, got {init!r}")

    def rebuild(params: list[TracedValue]) -> tuple[Any, ...]:
        return (tree.unflatten(params),)

    cond_region, pred = _trace_region(builder, "cond", cond_fn, carried, rebuild)
    if not isinstance(pred, MPObject) or pred.type != PREDICATE:
        got = pred.type if isinstance(pred, MPObject) else type(pred).__name__
        raise TraceError(
            f"{where}: cond_fn {function_name(cond_fn)} must return one {PREDICATE} party "
            f"value, got {got}"
        )
    pred = cond_region.value(pred, f"{where}: cond_fn {function_name(cond_fn)} result")
    body_region, result = _trace_region(builder, "body", body_fn, carried, rebuild)
    outs, out_tree = _party_leaves(body_region, result, f"{where}: body_fn output")
    _check_same(
        where, ("init", f"body_fn {function_name(body_fn)}"), (tree, out_tree), (carried, outs)
    )
    combined = _unify([cond_region, body_region], carried)
    regions = (cond_region.build_region([pred]), body_region.build_region(outs))
    out_parties = [v.parties for v in carried]
    taking_part = participants(regions[0]) | participants(regions[1])
    taking_part |= frozenset().union(*out_parties)
    _check_predicate_holders(
        where,
        pred.parties,
        taking_part,
        f"cond_fn {function_name(cond_fn)}'s result",
        f"broadcast it inside cond_fn, e.g. return mp.bcast({min(pred.parties)}, flag)",
    )
    results = builder.add_op(
        OpKind.WHILE,
        taking_part,
        combined,
        [v.type for v in carried],
        regions=regions,
        out_parties=out_parties,
    )
    return tree.unflatten(results)


def fori_loop(lower: int, upper: int, body_fn: Callable[[TracedValue, Any], Any], init: Any) -> Any:
    """`body_fn(i, x)` for i in range(lower, upper), carrying `x` (see `while_loop`).

    The bounds are Python ints; `i` is an i32[] party value held by every party taking part
    in the loop. The step counter runs on the host, so a step costs no extra device dispatch.
    """
    builder = current_builder("fori_loop")
    where = "mp.fori_loop"
    for name, bound in (("lower", lower), ("upper", upper)):
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise TraceError(
                f"{where}: expected a Python int {name} bound, got {type(bound).__name__}; "
                f"a bound that is a party value needs mp.while_loop"
            )
        if not -INDEX_LIMIT <= bound <= INDEX_LIMIT:
            raise TraceError(f"{where}: {name} bound {bound} does not fit in i32")
    start, in_tree = _party_leaves(builder, init, f"{where} init")
    if upper <= lower:
        return init
    world = builder.all_parties
    index = constant(np.int32(lower), parties=sorted(world))
    going = constant(True, parties=sorted(world))
    step = builtin.counter_pfunction(upper)
    counter: list[TracedValue] = []

    def body(state: tuple[TracedValue, TracedValue, Any]) -> tuple[Any, ...]:
        i, _, x = state
        following, more = run_pfunc(step, i, parties=sorted(world))
        counter.append(following)
        result = body_fn(i, x)
        name = f"body_fn {function_name(body_fn)}"
        outs, out_tree = _party_leaves(
            current_builder("fori_loop"), result, f"{where}: {name} output"
        )
        _check_same(where, ("init", name), (in_tree, out_tree), (start, outs))
        return following, more, result

    _, _, result = while_loop(lambda state: state[1], body, (index, going, init))
    _narrow_index(builder, [index, going], counter[0].ref.op)
    return result


def _narrow_index(builder: GraphBuilder, seeds: list[TracedValue], counter_op: int) -> None:
    """The loop just traced holds its index everywhere; hold it only where the loop has other
    work (the index is used nowhere else, since any use would be work there)."""
    loop = builder.ops[-1]
    cond, body = loop.regions
    others = Region(tuple(op for op in body.ops if op.id != counter_op), ())
    work = participants(others) | frozenset().union(*loop.out_parties[2:])
    if work == loop.parties or not work:
        return
    for seed in seeds:
        builder.ops[seed.ref.op] = dataclasses.replace(builder.ops[seed.ref.op], parties=work)
    regions = tuple(_narrow(r, {0, 1}, loop.parties, work) for r in (cond, body))
    builder.ops[-1] = dataclasses.replace(
        loop,
        parties=work,
        regions=regions,
        out_parties=(work, work, *loop.out_parties[2:]),
    )


def _narrow(region: Region, params: set[int], wide: PartySet, narrow: PartySet) -> Region:
    """`region` with parameters `params` and the values computed from them at `wide` (the
    counter) held at `narrow` instead."""
    narrowed: set[ValueRef] = set()
    ops = []
    for op in region.ops:
        param = op.kind is OpKind.INPUT and op.input_index in params
        counter = op.kind is OpKind.CALL and op.parties == wide and bool(narrowed & set(op.inputs))
        if param or counter:
            op = dataclasses.replace(op, parties=narrow)
            narrowed.update(ValueRef(op.id, i) for i in range(len(op.outs)))
        elif op.kind in (OpKind.COND, OpKind.WHILE):
            skip = 1 if op.kind is OpKind.COND else 0
            inner = {j - skip for j, r in enumerate(op.inputs) if r in narrowed and j >= skip}
            if inner:
                regions = tuple(_narrow(r, inner, wide, narrow) for r in op.regions)
                op = dataclasses.replace(op, regions=regions)
        ops.append(op)
    return Region(tuple(ops), region.outputs)
