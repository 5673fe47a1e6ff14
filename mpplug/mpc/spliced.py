"""Protocol steps traced once per signature and spliced into each share program that takes them:
a share program repeats a few steps (a product's truncation, a comparison) hundreds of times.

A method marked `traced_once` is traced the first time it meets its arguments' types and static
parameters, its PRF streams counted from 0; each call then binds one `splice` equation, which
`inline` (run by `rounds` before it schedules a program) replaces by the step's equations, their
streams moved to those the call reserved. The inlined program is equation for equation the one
that tracing each step in place makes: the same bytes, for a fraction of the trace. A step
called while another is being traced is traced in place, into it: it is traced once with its
caller anyway, and a trace of its own (a few milliseconds) would serve only that caller (a
comparison's `msb` makes seven ANDs of as many widths, at its own shape).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Primitive, Var

from mpplug.kernels.runtime import LRUCache
from mpplug.mpc.prf import prf_p
from mpplug.mpc.protocol import Context

STEPS = 4096
STEPS_BYTES = 64 << 20
EQUATION_BYTES = 1024
"""Traced steps a process keeps (one per method and signature; a program uses tens), at most
4,096 and 64 MiB counting about what an equation holds (its variables, parameters and source
information) for each equation of a step."""


@dataclass(frozen=True, eq=False)
class Step:
    """One method traced for one signature: inputs (role, keys, *dynamic arguments)."""

    closed: ClosedJaxpr
    streams: int
    """The PRF streams one call draws (numbered 0.. in `closed`)."""
    out_tree: Any


splice_p = Primitive("mpc_splice")
"""`splice(role, keys, *args, step=Step, base=b)`: the outputs of `step`, its stream s drawn as
stream b + s; `inline` replaces it by the step's equations."""
splice_p.multiple_results = True


@splice_p.def_abstract_eval
def _splice_abstract(*args: Any, step: Step, base: int) -> list[Any]:
    return list(step.closed.out_avals)


@splice_p.def_impl
def _splice_impl(*args: Any, step: Step, base: int) -> Any:
    raise RuntimeError("mpc splice runs only inside a traced share program (mp.mpc.run)")


_steps: LRUCache[tuple[Any, ...], Step] = LRUCache(
    STEPS, weigh=lambda step: EQUATION_BYTES * len(step.closed.jaxpr.eqns), max_weight=STEPS_BYTES
)

F = TypeVar("F", bound=Callable[..., Any])


class _Tracing(threading.local):
    depth = 0
    """Steps being traced on this thread, one inside another."""


_tracing = _Tracing()


def traced_once(method: F) -> F:
    """Mark `method(self, ctx, *args, **kwargs)` of a protocol as a step traced once per
    signature: its array arguments (tracers) are inputs, everything else (ints, dtypes, None)
    is static and names the signature. A call with a concrete array, an unhashable static
    argument, or made while another step is being traced, is traced in place."""

    @functools.wraps(method)
    def call(self: Any, ctx: Context, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, v in enumerate(leaves) if isinstance(v, Tracer)]
        key = _signature(self, method, ctx, leaves, tree, dynamic)
        if key is None or _tracing.depth:
            return method(self, ctx, *args, **kwargs)
        avals = key[-1]

        def trace() -> Step:
            found: list[Any] = []
            count = [0]

            def next_stream(many: int = 1) -> int:
                count[0] += many
                return count[0] - many

            def traced(role: Any, keys: Any, *values: Any) -> list[Any]:
                inner = Context(role, keys, ctx.frac_bits, next_stream, ctx.truncation)
                full = list(leaves)
                for i, value in zip(dynamic, values, strict=True):
                    full[i] = value
                call_args, call_kwargs = jax.tree.unflatten(tree, full)
                outs, out_tree = jax.tree.flatten(method(self, inner, *call_args, **call_kwargs))
                found.append(out_tree)
                return outs

            specs = [jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in avals]
            _tracing.depth += 1
            try:
                closed = jax.make_jaxpr(traced)(*specs)
            finally:
                _tracing.depth -= 1
            return Step(closed, count[0], found[-1])

        step = _steps.get_or_create(key, trace)
        base = ctx.next_stream(step.streams) if step.streams else 0
        outs = splice_p.bind(
            ctx.role, ctx.keys, *(leaves[i] for i in dynamic), step=step, base=base
        )
        return jax.tree.unflatten(step.out_tree, outs)

    return call  # type: ignore[return-value]


def _signature(
    protocol: Any,
    method: Callable[..., Any],
    ctx: Context,
    leaves: list[Any],
    tree: Any,
    dynamic: list[int],
) -> tuple[Any, ...] | None:
    """What a step's trace depends on, its last item the inputs' (shape, dtype, weak type);
    None where the call is traced in place: no array argument is a tracer, one is a concrete
    array, or a static argument is not hashable."""
    at = set(dynamic)
    if not dynamic or any(
        isinstance(v, np.ndarray | jax.Array) for i, v in enumerate(leaves) if i not in at
    ):
        return None
    static = tuple(None if i in at else (type(v), v) for i, v in enumerate(leaves))
    if not all(isinstance(v, Tracer) for v in (ctx.role, ctx.keys)):
        return None
    inputs = (ctx.role, ctx.keys, *(leaves[i] for i in dynamic))
    avals = tuple((tuple(v.shape), np.dtype(v.dtype), v.aval.weak_type) for v in inputs)
    x64 = bool(jax.config.read("jax_enable_x64"))
    key = (type(protocol), method.__name__, tree, static, ctx.frac_bits, ctx.truncation, x64)
    try:
        hash(key)
    except TypeError:
        return None
    return (*key, avals)


def inline(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with each `splice` replaced by its step's equations (and theirs, inside it),
    each stream moved by the splice's base; a role test (`role == r`) a step makes again is
    read from the first, as one context's `is_role` gives it."""
    jaxpr = closed.jaxpr
    if not any(e.primitive is splice_p for e in jaxpr.eqns):
        return closed
    roles = {e.invars[0] for e in jaxpr.eqns if e.primitive is splice_p}
    constvars, consts = list(jaxpr.constvars), list(closed.consts)
    held: dict[int, Var] = {}  # a step's constant (by id) -> the program's constvar
    tests: dict[tuple[Any, int], Any] = {}  # (role, r) -> the value of role == r
    eqns: list[JaxprEqn] = []

    def read(v: Any, env: dict[Any, Any]) -> Any:
        return v if isinstance(v, Literal) else env.get(v, v)

    def constant(value: Any, var: Var) -> Var:
        found = held.get(id(value))
        if found is None:
            found = held[id(value)] = Var(var.aval)
            constvars.append(found)
            consts.append(value)
        return found

    def walk(body: list[JaxprEqn], env: dict[Any, Any], base: int, fresh: bool) -> None:
        for eqn in body:
            invars = [read(v, env) for v in eqn.invars]
            if eqn.primitive is splice_p:
                step = eqn.params["step"]
                inner = step.closed.jaxpr
                inner_env = dict(zip(inner.invars, invars, strict=True))
                for var, value in zip(inner.constvars, step.closed.consts, strict=True):
                    inner_env[var] = constant(value, var)
                walk(inner.eqns, inner_env, base + eqn.params["base"], True)
                for out, v in zip(eqn.outvars, inner.outvars, strict=True):
                    env[out] = read(v, inner_env)
                continue
            test = _role_test(eqn, invars, roles)
            if test is not None and test in tests:
                env[eqn.outvars[0]] = tests[test]
                continue
            outvars = eqn.outvars
            if fresh:
                outvars = [type(v)(v.aval) for v in eqn.outvars]
                env.update(zip(eqn.outvars, outvars, strict=True))
            params = eqn.params
            if base and eqn.primitive is prf_p:
                params = {**params, "stream": params["stream"] + base}
            if fresh or params is not eqn.params or invars != eqn.invars:
                eqn = eqn.replace(invars=invars, outvars=outvars, params=params)
            if test is not None:
                tests[test] = outvars[0]
            eqns.append(eqn)

    env: dict[Any, Any] = {}
    walk(jaxpr.eqns, env, 0, False)
    outvars = [read(v, env) for v in jaxpr.outvars]
    flat = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=outvars)
    return ClosedJaxpr(flat, consts)


def _role_test(eqn: JaxprEqn, invars: list[Any], roles: set[Any]) -> tuple[Any, int] | None:
    """(role, r) where `eqn` computes role == r for a program's role, else None."""
    if eqn.primitive is not lax.eq_p or not isinstance(invars[1], Literal):
        return None
    if isinstance(invars[0], Literal) or invars[0] not in roles:
        return None
    return invars[0], int(invars[1].val)
