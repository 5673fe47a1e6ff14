"""The primitives of a multi-party program: run JAX, place constants, ranks, randomness
and move values between parties (everything is built on `shuffle_static`)."""

from __future__ import annotations

import operator
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mpplug.config import DATASET_NAME
from mpplug.core import PFunction, TableType, TensorType
from mpplug.core.graph import OpKind
from mpplug.core.mpobject import MPObject
from mpplug.core.parties import PartySet, format_parties
from mpplug.errors import MPPlugError, TraceError
from mpplug.frontend.jax_export import function_name, is_array_like, jax_export
from mpplug.frontend.tracer import GraphBuilder, TracedValue, current_builder, static_key
from mpplug.kernels import builtin
from mpplug.kernels.datasets import TABLE_WRITE_FORMATS
from mpplug.kernels.runtime import LRUCache

Party = int | str

_export_cache: LRUCache[Any, tuple[PFunction, Any]] = LRUCache(1024)


def _call(
    builder: GraphBuilder, pfunc: PFunction, args: Sequence[TracedValue], parties: PartySet
) -> list[TracedValue]:
    return builder.add_op(OpKind.CALL, parties, args, pfunc.outs_info, function=pfunc)


def _placed_jax(
    builder: GraphBuilder,
    where: str,
    parties: PartySet,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    leaves, tree = jax.tree.flatten((args, kwargs))
    # leaves first: a value captured from an enclosing scope may add a parameter (and flush)
    placed = [_leaf(builder, where, parties, i, leaf) for i, leaf in enumerate(leaves)]
    if builder.fuse:
        return builder.fused(parties).add(builder, fn, placed, tree)
    placed = [
        constant(leaf, parties=sorted(parties)) if isinstance(leaf, np.ndarray) else leaf
        for leaf in placed
    ]
    call_args, call_kwargs = jax.tree.unflatten(tree, placed)
    pfunc, in_vars, out_tree = _export(builder, fn, placed, tree, call_args, call_kwargs)
    outs = _call(builder, pfunc, in_vars, parties)
    return jax.tree.unflatten(out_tree, outs)


def _leaf(builder: GraphBuilder, where: str, parties: PartySet, i: int, leaf: Any) -> Any:
    """Argument leaf `i` of a call at `parties`: a party value held there, a host array as a
    numpy copy (as it is now), or any other value as it is."""
    if isinstance(leaf, MPObject):
        value = builder.value(leaf, f"{where} argument leaf {i}")
        if isinstance(value.type, TableType):
            raise TraceError(
                f"{where}: argument leaf {i} is a table ({value.type}); JAX takes arrays: "
                f"convert it with mp.to_tensor first"
            )
        if not parties <= value.parties:
            raise TraceError(
                f"{where}: argument leaf {i} ({value.type}) is held by "
                f"{format_parties(value.parties)}, not by {format_parties(parties)}; "
                f"move it first with mp.p2p or mp.bcast"
            )
        return value
    if is_array_like(leaf):
        if not hasattr(leaf, "__array__"):
            raise TraceError(f"{where}: argument leaf {i} ({leaf!r}) is a type, not a value")
        return np.array(leaf)
    return leaf


def _export(
    builder: GraphBuilder,
    fn: Callable[..., Any],
    leaves: list[Any],
    tree: Any,
    args: Any,
    kwargs: Any,
) -> tuple[PFunction, list[TracedValue], Any]:
    """jax_export, cached on (fn, platforms, tree, static leaves, input types)."""
    in_vars = [leaf for leaf in leaves if isinstance(leaf, TracedValue)]

    def export() -> tuple[PFunction, Any]:
        pfunc, _, out_tree = jax_export(fn, *args, platforms=builder.platforms, **kwargs)
        return pfunc, out_tree

    signature = tuple(
        leaf.type if isinstance(leaf, MPObject) else static_key(leaf) for leaf in leaves
    )
    identity = function_key(fn)
    if any(part is None for part in signature) or identity is None:
        pfunc, out_tree = export()  # a value that cannot be keyed safely: no caching
    else:
        key = (identity, builder.platforms, tree, signature)
        pfunc, out_tree = _export_cache.get_or_create(key, export)
    return pfunc, in_vars, out_tree


def function_key(fn: Callable[..., Any], seen: frozenset[int] = frozenset()) -> Any:
    """What an export of `fn` depends on besides its arguments, as a cache key: for a plain
    Python function its code and the values it closes over, its defaults and the globals its
    code names, functions among them keyed the same way (so a lambda written once in a loop
    is exported once, not once per iteration); builtins, ufuncs and jitted functions by
    identity. None when some such value cannot be keyed safely (a mutable object, a callable
    instance, a bound method): then nothing is cached."""
    if not isinstance(fn, types.FunctionType):
        fixed = types.BuiltinFunctionType | np.ufunc | type(jax.jit(abs))
        return (type(fn), fn) if isinstance(fn, fixed) else None
    if id(fn) in seen:
        return ("recursive", fn.__code__)
    inner = seen | {id(fn)}
    parts: list[Any] = [fn.__code__]
    values = [*(fn.__defaults__ or ()), *sorted((fn.__kwdefaults__ or {}).items())]
    values += [_cell(cell) for cell in fn.__closure__ or ()]
    scope = fn.__globals__
    values += [(name, scope[name]) for name in _global_names(fn.__code__) if name in scope]
    for value in values:
        key = _value_key(value, inner)
        if key is None:
            return None
        parts.append(key)
    return tuple(parts)


_EMPTY_CELL = ("empty cell",)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a variable not assigned yet
        return _EMPTY_CELL


def _global_names(code: types.CodeType) -> list[str]:
    """Names `code` (and code nested in it) may read as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return sorted(set(names))


def _value_key(value: Any, seen: frozenset[int]) -> Any:
    if isinstance(value, tuple | frozenset):
        keys = [_value_key(v, seen) for v in value]
        if any(k is None for k in keys):
            return None
        return (type(value), tuple(keys) if isinstance(value, tuple) else frozenset(keys))
    if isinstance(value, types.ModuleType):
        return (types.ModuleType, value)
    if isinstance(value, types.FunctionType):
        return function_key(value, seen)
    if value is _EMPTY_CELL:
        return value
    if isinstance(value, types.MethodType):
        return None  # its object may change
    return static_key(value)


def run_jax(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run JAX `fn` at the parties that hold all of its party-value arguments."""
    builder = current_builder("run_jax")
    holders = [v.parties for v in jax.tree.leaves((args, kwargs)) if isinstance(v, MPObject)]
    if not holders:
        raise TraceError(
            f"mp.run_jax({function_name(fn)}): no party-value argument tells where to run; "
            f"use mp.run_jax_at(party, ...)"
        )
    parties = frozenset.intersection(*holders)
    if not parties:
        held = ", ".join(format_parties(h) for h in holders)
        raise TraceError(
            f"mp.run_jax({function_name(fn)}): no party holds every argument (held by {held}); "
            f"move values with mp.p2p or use mp.run_jax_at"
        )
    return _placed_jax(builder, f"mp.run_jax({function_name(fn)})", parties, fn, args, kwargs)


def run_jax_at(party: Party, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run JAX `fn` at one party; its party-value arguments must be held there."""
    builder = current_builder("run_jax_at")
    rank = builder.resolve_party(party, f"mp.run_jax_at({party!r}, {function_name(fn)})")
    return _placed_jax(
        builder, f"mp.run_jax_at({rank}, {function_name(fn)})", frozenset({rank}), fn, args, kwargs
    )


def run_pfunc(pfunc: PFunction, *args: MPObject, parties: Any = None) -> list[TracedValue]:
    """Run any PFunction (any registered kernel) at `parties` (default: all holders)."""
    builder = current_builder("run_pfunc")
    values = [
        builder.value(a, f"mp.run_pfunc({pfunc.fn_name}) argument {i}") for i, a in enumerate(args)
    ]
    if parties is None:
        target = (
            frozenset.intersection(*(v.parties for v in values)) if values else builder.all_parties
        )
    else:
        target = builder.resolve_parties(parties, f"mp.run_pfunc({pfunc.fn_name})")
    got = tuple(v.type for v in values)
    if got != pfunc.ins_info:
        raise TraceError(
            f"mp.run_pfunc({pfunc.fn_name}): expected arguments "
            f"({', '.join(map(str, pfunc.ins_info))}), got ({', '.join(map(str, got))})"
        )
    for i, v in enumerate(values):
        if not target or not target <= v.parties:
            raise TraceError(
                f"mp.run_pfunc({pfunc.fn_name}): argument {i} is held by "
                f"{format_parties(v.parties)}, not by {format_parties(target)}"
            )
    return _call(builder, pfunc, values, target)


def constant(value: Any, parties: Any = None) -> TracedValue:
    """A host array embedded in the program, held by `parties` (default: all)."""
    builder = current_builder("constant")
    target = builder.resolve_parties(parties, "mp.constant")
    try:
        pfunc = builtin.constant_pfunction(value)
    except Exception as exc:
        raise TraceError(f"mp.constant: cannot embed {type(value).__name__}: {exc}") from None
    return _call(builder, pfunc, (), target)[0]


def prank(parties: Any = None) -> TracedValue:
    """Each party's own rank, an i32 scalar held by `parties` (default: all)."""
    builder = current_builder("prank")
    target = builder.resolve_parties(parties, "mp.prank")
    return _call(builder, builtin.rank_pfunction(), (), target)[0]


def prand(
    shape: int | Sequence[int] = (), parties: Any = None, dtype: Any = "uint32"
) -> TracedValue:
    """Private random words from each party's cryptographic source: `shape` an int or a
    tuple (as in NumPy), `dtype` uint32 (the default) or uint64."""
    builder = current_builder("prand")
    try:
        if isinstance(shape, bool):
            raise TypeError("a bool is not a shape")
        try:
            dims: tuple[Any, ...] = (operator.index(shape),)  # type: ignore[arg-type]
        except TypeError:
            dims = tuple(shape)  # type: ignore[arg-type]
        if any(isinstance(d, bool) for d in dims):
            raise TypeError("a bool is not a dimension")
        pfunc = builtin.random_pfunction(tuple(operator.index(d) for d in dims), dtype)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"mp.prand(shape={shape!r}, dtype={dtype!r}): {exc}") from None
    return _call(builder, pfunc, (), builder.resolve_parties(parties, "mp.prand"))[0]


def _check_name(where: str, name: Any, kind: str, kinds: str) -> None:
    if not isinstance(name, str) or not DATASET_NAME.fullmatch(name):
        raise TraceError(
            f"{where}: {kind} name is a letter then up to 63 letters, digits, '_' or '-' "
            f"(programs name {kinds}, never paths)"
        )


def read(party: Party, name: str, *, type: Any = None) -> TracedValue:
    """Party `party`'s dataset `name`, loaded there (it never passes through the driver).

    Its dtype and shape (a table dataset's columns and row count) come from the party while
    tracing; `type` (a TensorType or TableType) gives them when tracing without a cluster
    (`mp.compile`).
    """
    builder = current_builder("read")
    where = f"mp.read({party!r}, {name!r})"
    rank = builder.resolve_party(party, where)
    _check_name(where, name, "a dataset", "datasets")
    if type is not None:
        ttype = (
            type if isinstance(type, TensorType | TableType) else TensorType(type.dtype, type.shape)
        )
    elif builder.dataset_type is None:
        raise TraceError(f"{where}: tracing without a cluster; give the dataset's type=")
    else:
        try:
            ttype = builder.dataset_type(rank, name)
        except MPPlugError as exc:
            raise TraceError(f"{where}: {exc}") from None
    return _call(builder, builtin.read_pfunction(name, ttype), (), frozenset({rank}))[0]


def write(party: Party, name: str, value: MPObject, *, format: str | None = None) -> TracedValue:
    """Write `value`, held by `party`, there as its output `name`, atomically: an array as
    `<outputs>/<name>.npy`, a table as `<name>.parquet` (or `format="csv"`). Returns a bool[]
    at `party` that says it happened."""
    builder = current_builder("write")
    where = f"mp.write({party!r}, {name!r})"
    rank = builder.resolve_party(party, where)
    _check_name(where, name, "an output", "outputs")
    v = builder.value(value, f"{where} value")
    if rank not in v.parties:
        raise TraceError(
            f"{where}: the value is held by {format_parties(v.parties)}, not by party {rank}; "
            f"move it first with mp.p2p"
        )
    table = isinstance(v.type, TableType)
    chosen = format or ("parquet" if table else "npy")
    allowed = TABLE_WRITE_FORMATS if table else ("npy",)
    if chosen not in allowed:
        raise TraceError(
            f"{where}: a {'table' if table else 'array'} is written as "
            f"{' or '.join(allowed)}, got format={format!r}"
        )
    pfunc = builtin.write_pfunction(name, v.type, chosen)
    return _call(builder, pfunc, (v,), frozenset({rank}))[0]


def shuffle_static(x: MPObject | Sequence[MPObject], routing: Mapping[Party, Party]) -> TracedValue:
    """Move values: destination `d` receives the value held at `routing[d]`.

    `x` is one party value, or several of one type held by disjoint parties.
    """
    return _move("mp.shuffle_static", x, routing)


def _move(
    where: str, x: MPObject | Sequence[MPObject], routing: Mapping[Party, Party]
) -> TracedValue:
    """The SHUFFLE behind every mover; errors speak as `where`, the user's call."""
    builder = current_builder(where.removeprefix("mp."))
    operands = [x] if isinstance(x, MPObject) else list(x)
    if not operands:
        raise TraceError(f"{where}: expected at least one party value, got none")
    values = [builder.value(v, f"{where} value {i}") for i, v in enumerate(operands)]
    types = {v.type for v in values}
    if len(types) != 1:
        raise TraceError(f"{where}: the values must share one type, got {sorted(map(str, types))}")
    holders: dict[int, TracedValue] = {}
    for i, v in enumerate(values):
        overlap = v.parties & holders.keys()
        if overlap:
            raise TraceError(
                f"{where}: value {i} is held by {format_parties(v.parties)}, overlapping "
                f"another value at {format_parties(overlap)}"
            )
        holders.update(dict.fromkeys(v.parties, v))
    if not routing:
        raise TraceError(f"{where}: no destination")
    routes = []
    for dst, src in routing.items():
        d = builder.resolve_party(dst, f"{where} destination")
        s = builder.resolve_party(src, f"{where} source")
        if s not in holders:
            raise TraceError(
                f"{where}: party {s} does not hold the value (held by {format_parties(holders)})"
            )
        routes.append((d, s))
    routes.sort()
    dsts = [d for d, _ in routes]
    if len(set(dsts)) != len(dsts):
        raise TraceError(f"{where}: a destination appears twice in {routes}")
    (out,) = builder.add_op(
        OpKind.SHUFFLE, frozenset(dsts), values, (values[0].type,), routes=routes
    )
    return out


def p2p(src: Party, dst: Party, x: MPObject) -> TracedValue:
    """Send `x` from party `src` to party `dst`; the result is held by `dst`."""
    where = f"mp.p2p({src!r}, {dst!r}, x)"
    _check_mover(where, "mp.p2p(src, dst, x)", parties=(src, dst), value=x)
    return _move(where, x, {dst: src})


def bcast(src: Party, x: MPObject, to: Sequence[Party] | None = None) -> TracedValue:
    """Send `x` from `src` to every party in `to` (default: all)."""
    where = f"mp.bcast({src!r}, x)"
    _check_mover(where, "mp.bcast(src, x, to=None)", parties=(src,), value=x)
    builder = current_builder("bcast")
    targets = builder.resolve_parties(to, f"{where} to")
    return _move(where, x, dict.fromkeys(sorted(targets), src))


def _check_mover(where: str, signature: str, *, parties: Sequence[Any], value: Any) -> None:
    """A party where a value belongs, or the reverse, gets the expected signature named."""
    if isinstance(value, MPObject) and not any(isinstance(p, MPObject) for p in parties):
        return
    got = ", ".join(type(a).__name__ for a in (*parties, value))
    raise TraceError(
        f"{where}: expected {signature}, parties (ranks or names) first and the party value "
        f"last; got ({got})"
    )


def gather(dst: Party, x: MPObject) -> list[TracedValue]:
    """Every holder's value of `x`, delivered to `dst`: a list in rank order."""
    where = f"mp.gather({dst!r}, x)"
    _check_mover(where, "mp.gather(dst, x)", parties=(dst,), value=x)
    return [_move(where, x, {dst: src}) for src in sorted(x.parties)]


def converge(*xs: MPObject) -> TracedValue:
    """Values of one type held by disjoint parties become one value held by their union."""
    builder = current_builder("converge")
    if not xs:
        raise TraceError("mp.converge: expected at least one party value, got none")
    union = sorted(frozenset().union(*(builder.value(x, "mp.converge").parties for x in xs)))
    return _move("mp.converge", list(xs), {p: p for p in union})


__all__ = [
    "bcast",
    "constant",
    "converge",
    "gather",
    "p2p",
    "prand",
    "prank",
    "read",
    "run_jax",
    "run_jax_at",
    "run_pfunc",
    "shuffle_static",
    "write",
]
