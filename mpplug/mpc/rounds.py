"""Communication rounds: the `exchange` primitive inside a party's share program, and the
split of that program into one fused PFunction per round with SHUFFLEs between them.

A protocol writes what every computing party does as one JAX function (SPMD over roles) in
which `exchange` is the only communication. `emit_rounds` schedules each equation into a
round (exchanges as early as possible, local work as late as possible), packs the messages of
one round and one route pattern into a single uint64 vector, exports each round's local work
once and appends CALL and SHUFFLE ops to the program being traced.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var

from mpplug.frontend.jax_export import jax_export
from mpplug.frontend.primitives import run_pfunc, shuffle_static
from mpplug.frontend.tracer import TracedValue
from mpplug.mpc.prf import prf_many, prf_p

PER_ROLE_WORDS = 1 << 20
"""PRF words in a round (8 MiB of keystream, about 12 ms of ChaCha12 on one core) from which
each role draws only the streams it uses: the per-role branches of the round's PFunction
compile for seconds, and pay back only on large values."""

exchange_p = Primitive("mpc_exchange")
"""`exchange(x, sources=(s0, s1, s2), tag=...)`: role d receives the value role s_d holds
(s_d == d keeps its own and sends nothing); `tag` names the protocol step in the IR."""


@exchange_p.def_abstract_eval
def _exchange_abstract(x: Any, *, sources: tuple[int, ...], tag: str) -> Any:
    return x


@exchange_p.def_impl
def _exchange_impl(x: Any, *, sources: tuple[int, ...], tag: str) -> Any:
    raise RuntimeError("mpc exchange runs only inside a traced share program (mp.mpc.run)")


def exchange(x: jnp.ndarray, sources: Sequence[int], tag: str) -> jnp.ndarray:
    """Route `x` between the computing roles: role d gets role `sources[d]`'s value."""
    return exchange_p.bind(x, sources=tuple(sources), tag=tag)


@dataclass
class _Message:
    """The exchanges of one round with one route pattern, sent as one packed vector."""

    level: int
    sources: tuple[int, ...]
    dtype: Any
    eqns: list[JaxprEqn] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return "+".join(dict.fromkeys(e.params["tag"] for e in self.eqns))

    def spans(self) -> dict[Var, tuple[int, int]]:
        """Where each received value lies in the packed vector: (start, size)."""
        spans, start = {}, 0
        for eqn in self.eqns:
            size = _aval(eqn.invars[0]).size
            spans[eqn.outvars[0]] = (start, size)
            start += size
        return spans


def _aval(v: Any) -> Any:
    return v.aval


def _is_var(v: Any) -> bool:
    return isinstance(v, Var) and not isinstance(v, Literal)


def _live_eqns(jaxpr: Jaxpr) -> list[JaxprEqn]:
    """Equations that some output depends on (share programs have no side effects)."""
    needed = {v for v in jaxpr.outvars if _is_var(v)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            live.append(eqn)
            needed.update(v for v in eqn.invars if _is_var(v))
    return live[::-1]


@dataclass
class RoundPlan:
    """Each equation's round; `rounds` is the number of communication rounds."""

    eqns: list[JaxprEqn]
    level: dict[int, int]
    messages: list[_Message]
    rounds: int


def plan_rounds(jaxpr: Jaxpr) -> RoundPlan:
    eqns = _live_eqns(jaxpr)
    ready: dict[Any, int] = {}
    asap: dict[int, int] = {}
    for i, eqn in enumerate(eqns):
        start = max((ready.get(v, 0) for v in eqn.invars if _is_var(v)), default=0)
        asap[i] = start
        done = start + 1 if eqn.primitive is exchange_p else start
        for v in eqn.outvars:
            ready[v] = done
    rounds = max((ready.get(v, 0) for v in jaxpr.outvars if _is_var(v)), default=0)
    use: dict[Any, int] = {v: rounds for v in jaxpr.outvars if _is_var(v)}
    level: dict[int, int] = {}
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn.primitive is exchange_p or eqn.primitive is prf_p:
            level[i] = asap[i]  # randomness comes first, all of it in one batched call
        else:
            level[i] = min((use[v] for v in eqn.outvars if v in use), default=asap[i])
        for u in eqn.invars:
            if _is_var(u):
                use[u] = min(use.get(u, level[i]), level[i])
    groups: dict[tuple[int, tuple[int, ...], Any], _Message] = {}
    for i, eqn in enumerate(eqns):
        if eqn.primitive is exchange_p:
            key = (level[i], eqn.params["sources"], _aval(eqn.invars[0]).dtype)
            groups.setdefault(key, _Message(*key)).eqns.append(eqn)
    return RoundPlan(eqns, level, list(groups.values()), rounds)


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def _bind(eqn: JaxprEqn, env: dict[Any, Any]) -> None:
    params = eqn.primitive.get_bind_params(eqn.params)
    outs = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **params)
    if not eqn.primitive.multiple_results:
        outs = [outs]
    for v, out in zip(eqn.outvars, outs, strict=True):
        if _is_var(v):
            env[v] = out


def _last_use(plan: RoundPlan, jaxpr: Jaxpr) -> dict[Any, int]:
    """The latest round in which each variable is read (outputs: after the last round)."""
    last: dict[Any, int] = {}
    for i, eqn in enumerate(plan.eqns):
        for v in eqn.invars:
            if _is_var(v):
                last[v] = max(last.get(v, -1), plan.level[i])
    for v in jaxpr.outvars:
        if _is_var(v):
            last[v] = plan.rounds + 1
    return last


def emit_rounds(
    closed: ClosedJaxpr,
    inputs: Sequence[TracedValue],
    parties: Sequence[int],
    name: str,
    platforms: Sequence[str] | None,
) -> list[TracedValue]:
    """Append the share program `closed` (run by every party in `parties`, role i at
    `parties[i]`) to the program being traced, with `inputs` as its arguments there.

    Returns the program values of its outputs. Round r's local work is one PFunction, the
    same bytes at every computing party; each message of round r is one SHUFFLE.
    """
    jaxpr = closed.jaxpr
    plan = plan_rounds(jaxpr)
    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    held: dict[Var, TracedValue] = dict(zip(jaxpr.invars, inputs, strict=True))
    source: dict[Var, tuple[int, int, int]] = {}  # exchange output -> (message, start, size)
    for index, message in enumerate(plan.messages):
        for v, (start, size) in message.spans().items():
            source[v] = (index, start, size)
    packed: dict[int, TracedValue] = {}
    last_use = _last_use(plan, jaxpr)
    local: dict[int, list[JaxprEqn]] = defaultdict(list)
    for i, eqn in enumerate(plan.eqns):
        if eqn.primitive is not exchange_p:
            local[plan.level[i]].append(eqn)
    final = plan.rounds
    for level in range(final + 1):
        eqns = local.get(level, [])
        sends = [(i, m) for i, m in enumerate(plan.messages) if m.level == level]
        defined = dict.fromkeys(v for e in eqns for v in e.outvars if _is_var(v))
        reads = [v for e in eqns for v in e.invars]
        reads += [e.invars[0] for _, m in sends for e in m.eqns]
        keep = [v for v in defined if last_use.get(v, -1) > level]
        if level == final:
            missing = [v for v in jaxpr.outvars if _is_var(v) and v not in held]
            reads += missing
            keep = list(dict.fromkeys(keep + missing))
        if not eqns and not sends and not keep:
            continue
        needed = [v for v in dict.fromkeys(r for r in reads if _is_var(r)) if v not in defined]
        direct = [v for v in needed if v in held]
        messages = list(dict.fromkeys(source[v][0] for v in needed if v in source))
        segment = _segment(eqns, direct, messages, source, consts, keep, [m for _, m in sends])
        args = [held[v] for v in direct] + [packed[m] for m in messages]
        tags = "+".join(m.tag for _, m in sends) or "out"
        segment.__name__ = f"mpc.{name}.{tags}"
        with jax.enable_x64(True):
            pfunc, _, _ = jax_export(
                segment,
                *(jax.ShapeDtypeStruct(a.shape, a.dtype.numpy) for a in args),
                platforms=platforms,
            )
        results = run_pfunc(pfunc, *args, parties=list(parties))
        held.update(zip(keep, results, strict=False))
        for (index, message), vector in zip(sends, results[len(keep) :], strict=True):
            routes: dict[int | str, int | str] = {
                parties[d]: parties[s] for d, s in enumerate(message.sources)
            }
            packed[index] = shuffle_static(vector, routes)
    outputs = []
    for v in jaxpr.outvars:
        if not _is_var(v) or v not in held:
            raise AssertionError(f"share program output {v} was not computed")
        outputs.append(held[v])
    return outputs


def _segment(
    eqns: list[JaxprEqn],
    direct: list[Var],
    messages: list[int],
    source: dict[Var, tuple[int, int, int]],
    consts: dict[Var, Any],
    keep: list[Var],
    sends: list[_Message],
) -> Any:
    """The local work of one round as a plain function: (held values, received vectors) ->
    (values kept for later rounds, one packed vector per message sent)."""
    slot = {m: i for i, m in enumerate(messages)}
    randoms = [e for e in eqns if e.primitive is prf_p]
    key_work = _dependencies(eqns, [v for e in randoms for v in e.invars])
    first = {id(e) for e in key_work}
    rest = [e for e in eqns if e.primitive is not prf_p and id(e) not in first]

    def segment(*args: Any) -> tuple[Any, ...]:
        env: dict[Any, Any] = dict(consts)
        env.update(zip(direct, args, strict=False))
        vectors = args[len(direct) :]
        for v, (index, start, size) in source.items():
            if index in slot:
                env[v] = vectors[slot[index]][start : start + size].reshape(_aval(v).shape)
        for eqn in key_work:
            _bind(eqn, env)
        if randoms:
            words = _random_words(randoms, env)
            env.update((e.outvars[0], w) for e, w in zip(randoms, words, strict=True))
        for eqn in rest:
            _bind(eqn, env)
        kept = [_read(env, v) for v in keep]
        out = [jnp.concatenate([jnp.ravel(_read(env, e.invars[0])) for e in m.eqns]) for m in sends]
        return (*kept, *out)

    return segment


def _random_words(randoms: list[JaxprEqn], env: dict[Any, Any]) -> list[Any]:
    """Every PRF stream of a round in one batched ChaCha call. Where streams name the roles
    that use them and there are at least PER_ROLE_WORDS words, each role runs a branch
    computing only its own (zeros for the others), so a stream two roles share costs nothing
    at the third; a role above every named one runs the last branch, which draws only the
    streams every role uses. Below that size the branches cost more to compile than they
    save."""
    keys = [_read(env, e.invars[0]) for e in randoms]
    streams = [e.params["stream"] for e in randoms]
    shapes = [e.params["shape"] for e in randoms]
    users = [e.params["roles"] for e in randoms]
    words = sum(math.prod(shape) for shape in shapes)
    if all(u is None for u in users) or words < PER_ROLE_WORDS:
        return prf_many(keys, streams, shapes)
    count = 2 + max(max(u) for u in users if u is not None)

    def branch(role: int) -> Any:
        chosen = [i for i, u in enumerate(users) if u is None or role in u]

        def words(keys: list[Any]) -> list[Any]:
            out = [jnp.zeros(shape, jnp.uint64) for shape in shapes]
            if not chosen:
                return out
            drawn = prf_many(
                [keys[i] for i in chosen], [streams[i] for i in chosen], [shapes[i] for i in chosen]
            )
            for i, w in zip(chosen, drawn, strict=True):
                out[i] = w
            return out

        return words

    role = _read(env, next(e.invars[1] for e in randoms if e.params["roles"] is not None))
    return lax.switch(role, [branch(r) for r in range(count)], keys)


def _dependencies(eqns: list[JaxprEqn], targets: list[Any]) -> list[JaxprEqn]:
    """The equations among `eqns` that `targets` depend on, in order."""
    needed = {v for v in targets if _is_var(v)}
    chosen = []
    for eqn in reversed(eqns):
        if any(v in needed for v in eqn.outvars):
            chosen.append(eqn)
            needed.update(v for v in eqn.invars if _is_var(v))
    return chosen[::-1]
