"""`seal`, `run` and `reveal`: secure computation inside `@mp.function` programs.

`run` traces the user's JAX function to a jaxpr, interprets it on shares into one share
program (the same for every computing party) and emits it round by round (see `rounds`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: which inputs a jaxpr reads

from mpplug.core import PFunction, TensorType
from mpplug.core.mpobject import MPObject
from mpplug.core.parties import format_parties
from mpplug.errors import TraceError
from mpplug.frontend.jax_export import function_name
from mpplug.frontend.primitives import run_pfunc
from mpplug.frontend.tracer import GraphBuilder, TracedValue, current_builder
from mpplug.kernels.builtin import check_range_pfunction
from mpplug.kernels.collection import collection_paused
from mpplug.mpc import ring, trace_cache
from mpplug.mpc.aby3 import ABY3
from mpplug.mpc.interpreter import Interpreter, Secret, is_float
from mpplug.mpc.loops import Looping
from mpplug.mpc.protocol import TRUNCATIONS, Context, Protocol
from mpplug.mpc.recording import Recording
from mpplug.mpc.rounds import emitting, record_rounds
from mpplug.mpc.sealed import Sealed
from mpplug.runtime.profile import phase

DEFAULT_FRAC_BITS = 18
"""Fraction bits of fixed point, as SPU's FM64 default."""
RANGE_BITS = 62
"""Fixed-point values v must satisfy |v| 2^f < 2^62 (a quarter of the ring): then differences
compare exactly and precise truncation is exact to one unit; a product must satisfy it too,
with 2f fraction bits, before it is truncated."""


def fixed_point_limit(frac_bits: int) -> float:
    """The largest magnitude (exclusive) a sealed real may have: 2^(62 - frac_bits)."""
    return 2.0 ** (RANGE_BITS - frac_bits)


PROTOCOLS: dict[str, Protocol] = {"aby3": ABY3()}


@dataclass
class _ProgramState:
    """Per program being traced: each computing set's context values and stream counter."""

    contexts: dict[tuple[int, ...], list[TracedValue]] = field(default_factory=dict)
    stream: int = 0
    """The next PRF stream number."""

    def next_stream(self, count: int = 1) -> int:
        self.stream += count
        return self.stream - count


_states: weakref.WeakKeyDictionary[GraphBuilder, _ProgramState] = weakref.WeakKeyDictionary()


def _state(builder: GraphBuilder) -> _ProgramState:
    state = _states.get(builder)
    if state is None:
        state = _states[builder] = _ProgramState()
    return state


def _protocol(name: str, where: str) -> Protocol:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise TraceError(
            f"{where}: unknown protocol {name!r}; known: {', '.join(sorted(PROTOCOLS))}"
        ) from None


def _computing_parties(
    builder: GraphBuilder, parties: Any, protocol: Protocol, where: str
) -> tuple[int, ...]:
    n = protocol.n_parties
    if parties is None:
        if builder.world_size != n:
            raise TraceError(
                f"{where}: the world has {builder.world_size} parties; {protocol.name} computes "
                f"among exactly {n}: say which with parties=[...]"
            )
        return tuple(range(n))
    if isinstance(parties, int | str):
        parties = [parties]
    ranks = tuple(builder.resolve_party(p, where) for p in parties)
    if len(ranks) != n or len(set(ranks)) != n:
        raise TraceError(
            f"{where}: {protocol.name} expects {n} distinct computing parties, got {list(parties)}"
        )
    return ranks


def seal(
    x: Any,
    parties: Sequence[int | str] | None = None,
    *,
    frac_bits: int = DEFAULT_FRAC_BITS,
    truncation: str = "precise",
    protocol: str = "aby3",
) -> Any:
    """Secret-share `x` (a pytree of values each held by one party) among `parties`.

    Floats are encoded in fixed point with `frac_bits` fraction bits; their owner checks
    that every element is finite with |v| < 2^(62 - frac_bits) (`FixedPointRangeError`
    otherwise) where the value is read (`Sealed.checked`), and shares an element out of range
    as 0, which nothing reads then. Ints and bools stay integers. `truncation` picks how
    products are rescaled: "precise" (off by at most one unit in the last place) or
    "probabilistic" (cheaper, and rarely wrong by a lot; see docs/mpc.md). The holder may be
    inside or outside the computing set.
    """
    builder = current_builder("mpc.seal")
    where = "mp.mpc.seal"
    proto = _protocol(protocol, where)
    ranks = _computing_parties(builder, parties, proto, where)
    if not 0 < frac_bits < 32:
        raise TraceError(f"{where}: expected frac_bits in 1..31, got {frac_bits}")
    if truncation not in TRUNCATIONS:
        raise TraceError(
            f"{where}: expected truncation in {', '.join(map(repr, TRUNCATIONS))}, "
            f"got {truncation!r}"
        )
    leaves, tree = jax.tree.flatten(x, is_leaf=lambda v: isinstance(v, Sealed))
    if not leaves:
        raise TraceError(f"{where}: expected party values to seal, got {x!r}")
    sealed = []
    for i, leaf in enumerate(leaves):
        at = f"{where} leaf {i}"
        if isinstance(leaf, Sealed):
            raise TraceError(f"{at}: {leaf!r} is sealed already")
        if not isinstance(leaf, MPObject):
            raise TraceError(
                f"{at}: expected a party value (the result of an mp primitive or a program "
                f"argument), got {type(leaf).__name__}; public constants need no sealing: "
                f"pass them to mp.mpc.run as they are"
            )
        value = builder.value(leaf, at)
        if not isinstance(value.type, TensorType):
            raise TraceError(f"{at}: a table ({value.type}) cannot be sealed: mp.to_tensor first")
        if len(value.parties) != 1:
            raise TraceError(
                f"{at}: expected a value held by one party, got one held by "
                f"{format_parties(value.parties)}; pick its owner first, e.g. with mp.p2p"
            )
        (owner,) = value.parties
        dtype = value.dtype.numpy
        range_check = None
        encode = ring.Encoding()
        if is_float(dtype):
            label = (
                f"{at} ({value.type} from {format_parties(value.parties)}; fixed point with "
                f"frac_bits={frac_bits} holds |v| < 2^{RANGE_BITS - frac_bits})"
            )
            limit = fixed_point_limit(frac_bits)
            range_check = _range_check(check_range_pfunction(value.type, limit, label), value)
            encode = ring.Encoding(frac_bits, limit)
        shares = proto.share(value, owner, ranks, encode)
        sealed.append(
            Sealed(
                shares,
                value.shape,
                dtype,
                ranks,
                frac_bits=frac_bits,
                protocol=proto.name,
                truncation=truncation,
                range_check=range_check,
            )
        )
    return jax.tree.unflatten(tree, sealed)


def _range_check(check: PFunction, value: TracedValue) -> Callable[[], None]:
    """Emit `check` of the owner's `value` into the program or region being traced, once
    each, where that is the seal's own or one inside it. Elsewhere the sealed value is
    leaving the seal's region (flattened as its output), which checked it as it left, or is
    outside any program, where nothing computes on it."""
    home = current_builder("mpc.seal")
    done: weakref.WeakSet[GraphBuilder] = weakref.WeakSet()

    def emit() -> None:
        try:
            builder = current_builder("mpc")
        except TraceError:
            return
        inside: GraphBuilder | None = builder
        while inside is not None and inside is not home:
            inside = inside.parent
        if inside is home and builder not in done:
            done.add(builder)
            run_pfunc(check, value, parties=sorted(value.parties))

    return emit


def _x64_needed(dtypes: Sequence[Any]) -> bool:
    return any(np.dtype(d).itemsize == 8 for d in dtypes)


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run the JAX function `fn` on sealed values (and public ones) under the protocol.

    Sealed leaves are secret inputs; party values held by every computing party are public
    inputs; anything else is a constant of the computation. Every output comes back sealed.
    """
    builder = current_builder("mpc.run")
    name = function_name(fn)
    where = f"mp.mpc.run({name})"
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=lambda v: isinstance(v, Sealed))
    sealed = [leaf for leaf in leaves if isinstance(leaf, Sealed)]
    if not sealed:
        raise TraceError(f"{where}: expected at least one sealed argument (mp.mpc.seal), got none")
    first = sealed[0]
    for s in sealed[1:]:
        agreed = (s.parties, s.frac_bits, s.protocol, s.truncation)
        if agreed != (first.parties, first.frac_bits, first.protocol, first.truncation):
            raise TraceError(
                f"{where}: sealed arguments disagree: {first!r} and {s!r} (computing parties, "
                f"fixed point, truncation and protocol must match)"
            )
    proto = _protocol(first.protocol, where)
    parties = first.parties
    dynamic: list[int] = []
    secret_inputs: list[TracedValue] = []
    public_inputs: list[TracedValue] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Sealed):
            dynamic.append(i)
            secret_inputs.append(builder.value(leaf.shares, f"{where} sealed argument {i}"))
        elif isinstance(leaf, MPObject):
            value = builder.value(leaf, f"{where} argument leaf {i}")
            if not set(parties) <= value.parties:
                raise TraceError(
                    f"{where}: argument leaf {i} ({value.type}) is held by "
                    f"{format_parties(value.parties)}; a public input must be held by every "
                    f"computing party {format_parties(parties)} (seal it if it is secret)"
                )
            dynamic.append(i)
            public_inputs.append(value)
    specs = [
        jax.ShapeDtypeStruct(
            leaves[i].shape,
            np.dtype(leaves[i].dtype) if isinstance(leaves[i], Sealed) else leaves[i].dtype.numpy,
        )
        for i in dynamic
    ]
    out_trees: list[Any] = []

    def flat_fn(*values: Any) -> list[Any]:
        full = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            full[i] = value
        call_args, call_kwargs = jax.tree.unflatten(tree, full)
        outs, out_tree = jax.tree.flatten(fn(*call_args, **call_kwargs))
        out_trees.append(out_tree)
        return outs

    x64 = _x64_needed([s.dtype for s in specs])
    with jax.enable_x64(x64 or bool(jax.config.read("jax_enable_x64"))):
        closed = jax.make_jaxpr(flat_fn)(*specs)
    _, read = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    for i, is_read in zip(dynamic, read, strict=True):
        if is_read and isinstance(leaves[i], Sealed):
            leaves[i].checked()
    state = _state(builder)
    context = state.contexts.get(parties)
    if context is None:
        context = state.contexts[parties] = proto.setup(parties)
    secret_positions = {i for i in dynamic if isinstance(leaves[i], Sealed)}
    inputs = [
        f"secret {leaves[i].shape} {np.dtype(leaves[i].dtype).str} {leaves[i].boolean} "
        f"{leaves[i].wide}"
        if i in secret_positions
        else f"public {spec.shape} {np.dtype(spec.dtype).str}"
        for i, spec in zip(dynamic, specs, strict=True)
    ]
    settings = (
        proto.name,
        parties,
        first.frac_bits,
        first.truncation,
        builder.platforms,
        state.stream,
        name,
        [(v.shape, v.dtype.numpy.str) for v in context],
        emitting(),
    )
    key = trace_cache.trace_key(closed, inputs, settings)
    with phase("mpc recording loaded") as details:
        recording = trace_cache.load(key)
        details["found"] = recording is not None
    if recording is None:
        with collection_paused():
            recording = _record(
                closed,
                leaves,
                dynamic,
                secret_positions,
                first,
                proto,
                context,
                public_inputs,
                state,
                name,
                builder.platforms,
            )
        trace_cache.store(key, recording)
    else:
        state.stream += recording.streams
    outputs = recording.replay([*context, *secret_inputs, *public_inputs], parties)
    results = [
        Sealed(
            out,
            shape,
            dtype,
            parties,
            frac_bits=first.frac_bits,
            boolean=boolean,
            protocol=proto.name,
            truncation=first.truncation,
            wide=wide,
        )
        for out, (shape, dtype, boolean, wide) in zip(outputs, recording.metas, strict=True)
    ]
    return jax.tree.unflatten(out_trees[-1], results)


def _record(
    closed: Any,
    leaves: list[Any],
    dynamic: list[int],
    secret_positions: set[int],
    first: Sealed,
    proto: Protocol,
    context: list[TracedValue],
    public_inputs: list[TracedValue],
    state: _ProgramState,
    name: str,
    platforms: Sequence[str] | None,
) -> Recording:
    """Interpret the user's jaxpr on shares into the share program, and split it into rounds."""
    where = f"mp.mpc.run({name})"
    start = state.stream
    metas: list[tuple[tuple[int, ...], np.dtype[Any], bool, bool]] = []
    n_secret = len(secret_positions)

    def share_program(role: Any, keys: Any, *inputs: Any) -> list[Any]:
        ctx = Context(role, keys, first.frac_bits, state.next_stream, first.truncation)
        interpreter = Interpreter(proto, ctx, where, Looping(platforms))
        secrets = iter(inputs[:n_secret])
        publics = iter(inputs[n_secret:])
        values = []
        for i in dynamic:
            if i in secret_positions:
                s = leaves[i]
                values.append(Secret(next(secrets), s.shape, s.dtype, s.boolean, s.wide))
            else:
                values.append(next(publics))
        outs = interpreter.eval(closed.jaxpr, closed.consts, values, label=where)
        shares = []
        for out in outs:
            if isinstance(out, Secret):
                metas.append((out.shape, out.dtype, out.boolean, out.wide))
                shares.append(out.shares)
            else:
                public = jnp.asarray(out)
                metas.append((public.shape, public.dtype, False, False))
                shares.append(interpreter.arith(public, public.dtype))
        return shares

    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype.numpy) for v in context]
    avals += [proto.shares_aval(leaves[i].shape) for i in sorted(secret_positions)]
    avals += [jax.ShapeDtypeStruct(v.shape, v.dtype.numpy) for v in public_inputs]
    with jax.enable_x64(True), phase("mpc share program") as details:
        program = jax.make_jaxpr(share_program)(*avals)
        details["equations"] = len(program.jaxpr.eqns)
    recording = record_rounds(program, avals, platforms, label=where)
    recording.metas = [
        (tuple(shape), np.dtype(dtype), boolean, wide) for shape, dtype, boolean, wide in metas
    ]
    recording.streams = state.stream - start
    return recording


def reveal(x: Any, to: int | str | Sequence[int | str] | None = None) -> Any:
    """Open sealed values: to one party, a list of parties, or (None) every computing party.

    Returns party values held by exactly those parties.
    """
    builder = current_builder("mpc.reveal")
    where = "mp.mpc.reveal"
    leaves, tree = jax.tree.flatten(x, is_leaf=lambda v: isinstance(v, Sealed))
    opened = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Sealed):
            raise TraceError(f"{where}: leaf {i} is {type(leaf).__name__}, not a sealed value")
        shares = builder.value(leaf.checked().shares, f"{where} leaf {i}")
        targets = leaf.parties if to is None else builder.resolve_parties(to, where)
        decode = ring.Decoding(np.dtype(leaf.dtype), leaf.frac_bits, leaf.boolean)
        proto = _protocol(leaf.protocol, where)
        opened.append(proto.open(shares, leaf.boolean, leaf.parties, sorted(targets), decode))
    return jax.tree.unflatten(tree, opened)
