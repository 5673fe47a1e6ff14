"""Communication rounds: the `exchange` primitive inside a party's share program, and the
split of that program into one fused PFunction per round with SHUFFLEs between them.

A protocol writes what every computing party does as one JAX function (SPMD over roles) in
which `exchange` is the only communication. `record_rounds` schedules each equation into a
round (exchanges as early as possible, but those needing nothing received as late as their
use allows; local work as late as possible), packs the messages of one round and one route
pattern into a single vector, exports each round's local work
once and records the CALL and SHUFFLE steps that wire them (see `recording`). A loop of the
share program (`loop`, made by `loops`) stands between two rounds, like a message.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var

from mpplug.core import PFunction, TensorType, progress
from mpplug.frontend.jax_export import jax_export
from mpplug.kernels.builtin import constant_pfunction
from mpplug.kernels.keystream import BLOCK_WORDS_64, keystream_pfunction, stream_offsets
from mpplug.mpc import emit, spliced
from mpplug.mpc.prf import KEY_WORDS, blocks_for, picked_row, prf_p, stream_view
from mpplug.mpc.recording import Recording
from mpplug.runtime.profile import phase

log = logging.getLogger(__name__)

exchange_p = Primitive("mpc_exchange")
"""`exchange(x, sources=(s0, s1, s2), tag=...)`: role d receives the value role s_d holds
(s_d == d keeps its own and sends nothing); `tag` names the protocol step in the IR."""


def tensor_outs(pfunc: PFunction) -> list[TensorType]:
    """A share program's output types: always arrays."""
    return [t for t in pfunc.outs_info if isinstance(t, TensorType)]


@exchange_p.def_abstract_eval
def _exchange_abstract(x: Any, *, sources: tuple[int, ...], tag: str) -> Any:
    return x


@exchange_p.def_impl
def _exchange_impl(x: Any, *, sources: tuple[int, ...], tag: str) -> Any:
    raise RuntimeError("mpc exchange runs only inside a traced share program (mp.mpc.run)")


def exchange(x: jnp.ndarray, sources: Sequence[int], tag: str) -> jnp.ndarray:
    """Route `x` between the computing roles: role d gets role `sources[d]`'s value."""
    return exchange_p.bind(x, sources=tuple(sources), tag=tag)


ITERATION = jax.ShapeDtypeStruct((), np.int32)
"""A loop body's first input: which iteration it runs."""


@dataclass(frozen=True, eq=False)
class Body:
    """A loop's body, recorded: inputs (iteration, *invariants, *carry), outputs the carry."""

    recording: Recording
    n_invariants: int


loop_p = Primitive("mpc_loop")
"""`loop(*invariants, *carry, body=Body, length=n, out=avals)`: the carry after `n` runs of
`body` (made by `loops`), or with n = `recording.WHILE` after the runs until the body's
second output is false (made by `quicksort`); it stands between two rounds of a share
program, as a message."""
loop_p.multiple_results = True


@loop_p.def_abstract_eval
def _loop_abstract(*args: Any, body: Body, length: int, out: tuple[Any, ...]) -> list[Any]:
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in out]


@loop_p.def_impl
def _loop_impl(*args: Any, body: Body, length: int, out: tuple[Any, ...]) -> Any:
    raise RuntimeError("mpc loop runs only inside a traced share program (mp.mpc.run)")


@dataclass
class _Message:
    """The exchanges of one round with one route pattern, sent as one packed vector: of
    their element type, or where they have several, of unsigned words as wide as the
    narrowest (each value's bits, reinterpreted)."""

    level: int
    sources: tuple[int, ...]
    boolean: bool
    eqns: list[JaxprEqn] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return "+".join(dict.fromkeys(e.params["tag"] for e in self.eqns))

    @property
    def dtype(self) -> np.dtype:
        """The packed vector's element type."""
        types = {np.dtype(_aval(e.invars[0]).dtype) for e in self.eqns}
        if len(types) == 1:
            return types.pop()
        return np.dtype(f"uint{8 * min(t.itemsize for t in types)}")

    def spans(self) -> dict[Var, tuple[int, int]]:
        """Where each received value lies in the packed vector: (start, size)."""
        spans, start, width = {}, 0, self.dtype.itemsize
        for eqn in self.eqns:
            aval = _aval(eqn.invars[0])
            size = aval.size * np.dtype(aval.dtype).itemsize // width
            spans[eqn.outvars[0]] = (start, size)
            start += size
        return spans


def _aval(v: Any) -> Any:
    return v.aval


def _is_var(v: Any) -> bool:
    return isinstance(v, Var)  # a Literal is not a Var


def _live_eqns(jaxpr: Jaxpr) -> tuple[list[JaxprEqn], list[list[Var]]]:
    """Equations that some output depends on (share programs have no side effects), and
    each one's variable inputs."""
    needed = {v for v in jaxpr.outvars if _is_var(v)}
    live, inputs = [], []
    for eqn in reversed(jaxpr.eqns):
        outvars = eqn.outvars
        if outvars[0] in needed if len(outvars) == 1 else any(v in needed for v in outvars):
            ins = [v for v in eqn.invars if type(v) is not Literal]
            needed.update(ins)
            live.append(eqn)
            inputs.append(ins)
    return live[::-1], inputs[::-1]


@dataclass
class RoundPlan:
    """Each equation's round and variable inputs; `rounds` is the number of communication
    rounds."""

    eqns: list[JaxprEqn]
    inputs: list[list[Var]]
    level: list[int]
    messages: list[_Message]
    rounds: int


def plan_rounds(jaxpr: Jaxpr) -> RoundPlan:
    eqns, inputs = _live_eqns(jaxpr)
    ready: dict[Any, int] = dict.fromkeys([*jaxpr.invars, *jaxpr.constvars], 0)
    asap = []
    for eqn, ins in zip(eqns, inputs, strict=True):
        start = max(map(ready.__getitem__, ins), default=0)
        asap.append(start)
        done = start + 1 if eqn.primitive in (exchange_p, loop_p) else start
        for v in eqn.outvars:
            ready[v] = done
    rounds = max((ready.get(v, 0) for v in jaxpr.outvars if _is_var(v)), default=0)
    outs = [v for v in jaxpr.outvars if _is_var(v)]
    level = _levels(eqns, inputs, asap, rounds, outs, {})
    level = _levels(eqns, inputs, asap, rounds, outs, _deferred(eqns, asap, level))
    groups: dict[tuple[int, tuple[int, ...], bool], _Message] = {}
    for i, eqn in enumerate(eqns):
        if eqn.primitive is exchange_p:
            key = (level[i], *_route(eqn))
            groups.setdefault(key, _Message(*key)).eqns.append(eqn)
    return RoundPlan(eqns, inputs, level, list(groups.values()), rounds)


def _levels(
    eqns: list[JaxprEqn],
    inputs: list[list[Var]],
    asap: list[int],
    rounds: int,
    outs: list[Any],
    sends: dict[int, int],
) -> list[int]:
    """Each equation's round: an exchange's as early as possible (one that needs nothing
    received: the round `sends` gives it, else the last before its value is used), local
    work as late as possible."""
    use: dict[Any, int] = dict.fromkeys(outs, rounds)
    level = [0] * len(eqns)
    early = (exchange_p, prf_p, loop_p)
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        primitive = eqn.primitive
        if primitive is exchange_p and asap[i] == 0:
            first_use = _first_use(use, eqn.outvars, 1)
            at = sends.get(i, max(0, first_use - 1))
        elif primitive in early:
            at = asap[i]  # randomness comes first, all of it in one batched call
        else:
            at = _first_use(use, eqn.outvars, asap[i])
        level[i] = at
        for u in inputs[i]:
            if use.get(u, at) >= at:
                use[u] = at
    return level


def _first_use(use: dict[Any, int], outvars: list[Any], unused: int) -> int:
    """The earliest round that reads one of `outvars`, `unused` where none is read."""
    if len(outvars) == 1:
        return use.get(outvars[0], unused)
    return min([use[v] for v in outvars if v in use], default=unused)


def _route(eqn: JaxprEqn) -> tuple[tuple[int, ...], bool]:
    """What an exchange's message is sent with: its sources, and whether it is of booleans
    (whose bits cannot be reinterpreted as words)."""
    return eqn.params["sources"], np.dtype(_aval(eqn.invars[0]).dtype) == np.bool_


def _deferred(eqns: list[JaxprEqn], asap: list[int], latest: list[int]) -> dict[int, int]:
    """The rounds of the exchanges that need nothing received (a dealer's correlated
    randomness, such as a precise truncation's c1), given the latest each can be sent in:
    the latest round up to that one that sends on the same route anyway, so that it adds
    no message, else that one. Sent in the first round, as soon as they could be, all their
    work made that round one function of hundreds of outputs (the MLP step's: 74 KB of
    StableHLO, 0.3 s to load compiled)."""
    sending: dict[Any, set[int]] = defaultdict(set)  # route -> the rounds that send on it
    free = []
    for i, eqn in enumerate(eqns):
        if eqn.primitive is exchange_p:
            if asap[i] > 0:
                sending[_route(eqn)].add(asap[i])
            else:
                free.append(i)
    chosen = {}
    for i in sorted(free, key=latest.__getitem__):
        rounds, last = sending[_route(eqns[i])], latest[i]
        chosen[i] = max((r for r in rounds if r <= last), default=last)
        rounds.add(chosen[i])
    return chosen


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
    for ins, at in zip(plan.inputs, plan.level, strict=True):
        for v in ins:
            if last.get(v, -1) < at:
                last[v] = at
    for out in jaxpr.outvars:
        if _is_var(out):
            last[out] = plan.rounds + 1
    return last


def record_rounds(
    closed: ClosedJaxpr,
    input_types: Sequence[jax.ShapeDtypeStruct],
    platforms: Sequence[str] | None,
    iteration: tuple[int, int] | None = None,
    label: str | None = None,
) -> Recording:
    """Split the share program `closed` (run by every computing party) into rounds: round
    r's local work is one PFunction, the same bytes at every party, each message of round r
    one SHUFFLE and each loop one LOOP. Returns them as a `Recording` (inputs: `closed`'s
    arguments). A loop's body gives `iteration` = (its iteration input, the streams one
    iteration draws): its PRF streams move on by that many each iteration. With a `label`,
    how many rounds are written so far is logged under it (see `progress.Steps`)."""
    with phase("mpc rounds") as details:
        recording = _recorded(closed, input_types, platforms, iteration, label)
        details["functions"] = len(recording.functions)
    return recording


def _recorded(
    closed: ClosedJaxpr,
    input_types: Sequence[jax.ShapeDtypeStruct],
    platforms: Sequence[str] | None,
    iteration: tuple[int, int] | None,
    label: str | None,
) -> Recording:
    closed = spliced.inline(closed)
    jaxpr = closed.jaxpr
    with phase("mpc rounds scheduled"):
        plan = plan_rounds(jaxpr)
    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    recording = Recording(len(input_types))
    types: list[jax.ShapeDtypeStruct] = list(input_types)
    held: dict[Any, int] = dict(zip(jaxpr.invars, range(len(input_types)), strict=True))
    # a value read from a vector: exchange output -> (message, start, size), or a value a
    # round handed on packed -> (("kept", vector), start, size)
    source: dict[Var, tuple[Any, int, int]] = {}
    for index, message in enumerate(plan.messages):
        for v, (start, size) in message.spans().items():
            source[v] = (index, start, size)
    packed: dict[Any, int] = {}  # message or kept vector -> its value
    later: dict[int, jax.ShapeDtypeStruct] = {}  # values the call prepended last makes
    last_use = _last_use(plan, jaxpr)
    local: dict[int, list[JaxprEqn]] = defaultdict(list)
    loops: dict[int, list[JaxprEqn]] = defaultdict(list)
    for i, eqn in enumerate(plan.eqns):
        if eqn.primitive is loop_p:
            loops[plan.level[i]].append(eqn)
        elif eqn.primitive is not exchange_p:
            local[plan.level[i]].append(eqn)
    randoms = [e for e in plan.eqns if e.primitive is prf_p]
    randomness = None
    if randoms:
        stepping = None if iteration is None else (jaxpr.invars[iteration[0]], iteration[1])
        randomness = _Randomness(randoms, plan, stepping)
    final = plan.rounds
    derived = _stream_derived(plan.eqns, randomness)
    remade = {*randomness.index, *derived} if randomness is not None else set()
    steps = progress.Steps(label, "wrote", final + 1, "rounds") if label else None
    for level in range(final + 1):
        if steps is not None and level:
            steps.step(level)
        if randomness is not None and level == randomness.level:
            held[BUFFER] = randomness.record_draw(recording, types, held, consts, platforms)
        eqns = [e for e in local.get(level, []) if e.primitive is not prf_p]
        sends = [(i, m) for i, m in enumerate(plan.messages) if m.level == level]
        entering: list[Any] = [
            v for e in loops.get(level, []) for v in e.invars if _is_var(v) and v not in held
        ]
        missing: list[Var] = []
        if level == final:
            missing = [v for v in jaxpr.outvars if _is_var(v) and v not in held]
        reads = [v for e in eqns for v in e.invars]
        reads += [e.invars[0] for _, m in sends for e in m.eqns]
        reads += entering + missing
        made_here = {v for e in eqns for v in e.outvars}
        again = [
            v for v in reads if _is_var(v) and v in derived and v not in made_here and v not in held
        ]
        if again:  # remade from the keystream buffer, not received from an earlier round
            chain = _made_by(derived, again, made_here)
            eqns = chain + eqns
            reads += [v for e in chain for v in e.invars]
        defined = dict.fromkeys(v for e in eqns for v in e.outvars if _is_var(v))
        keep: list[Any] = [v for v in defined if last_use.get(v, -1) > level]
        keep = list(dict.fromkeys(keep + entering + missing))
        views: list[Var] = []
        if randomness is not None:
            views = randomness.ordered(
                [
                    v
                    for v in dict.fromkeys(r for r in [*reads, *keep] if _is_var(r))
                    if v in randomness.index
                ]
            )
            kept = {*missing, *entering}
            keep = [v for v in keep if v not in remade or v in kept]
        if eqns or sends or keep:
            needed: list[Any] = [
                v for v in dict.fromkeys(r for r in reads if _is_var(r)) if v not in defined
            ]
            if randomness is not None and views:
                starts, starts_type = randomness.starts(views)
                held[STARTS], later[starts] = starts, starts_type
                needed = [v for v in needed if v not in randomness.index]
                needed += [BUFFER, STARTS]
                needed += [randomness.role] if randomness.role is not None else []
                needed = list(dict.fromkeys(needed))
            direct = [v for v in needed if v in held]
            unpacked = {v: source[v] for v in needed if v in source and v not in held}
            messages = list(dict.fromkeys(where[0] for where in unpacked.values()))
            solo, packs = _packs(keep, {*missing, *entering})
            segment = _segment(
                eqns,
                direct,
                messages,
                unpacked,
                consts,
                solo,
                packs,
                [m for _, m in sends],
                randomness,
                views,
            )
            args = [held[v] for v in direct] + [packed[m] for m in messages]
            tags = "+".join(m.tag for _, m in sends) or "out"
            inputs = [types[a] if a >= 0 else later[a] for a in args]
            pfunc = _round_function(segment, f"mpc.{tags}", inputs, platforms)
            results = recording.call(pfunc, args)
            types += [jax.ShapeDtypeStruct(t.shape, t.dtype.numpy) for t in tensor_outs(pfunc)]
            held.update(zip(solo, results, strict=False))
            bundles = results[len(solo) : len(solo) + len(packs)]
            for group, vector in zip(packs, bundles, strict=True):
                packed["kept", vector] = vector
                start = 0
                for v in group:
                    source[v] = (("kept", vector), start, _aval(v).size)
                    start += _aval(v).size
            for (index, message), vector in zip(
                sends, results[len(solo) + len(packs) :], strict=True
            ):
                packed[index] = recording.shuffle(vector, message.sources)
                types.append(types[vector])
        for eqn in loops.get(level, []):
            body: Body = eqn.params["body"]
            args = [held[v] for v in eqn.invars]
            results = recording.loop(
                body.recording,
                args[: body.n_invariants],
                args[body.n_invariants :],
                eqn.params["length"],
            )
            types += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in eqn.params["out"]]
            held.update(zip(eqn.outvars, results, strict=True))
    if steps is not None:
        steps.end()
    for v in jaxpr.outvars:
        if not _is_var(v) or v not in held:
            raise AssertionError(f"share program output {v} was not computed")
        recording.outputs.append(held[v])
    if randomness is not None and randomness.tables:
        recording.prepend_call(constant_pfunction(*randomness.tables))
    return recording


PACKED_BYTES = 64 << 10
"""Values a round hands on that are at most this big travel to later rounds in one vector
per element type: fewer inputs and outputs to check and move per call (the MLP step's rounds
had 8 inputs and 5 outputs each on average), at the cost of copying them once."""


def _packs(keep: list[Any], alone: set[Any]) -> tuple[list[Any], list[list[Var]]]:
    """The values of `keep` a round outputs alone (those of `alone`, the big ones, and any
    that would be a vector's only value), and its groups of small values of one type."""
    groups: dict[Any, list[Var]] = {}
    for v in keep:
        aval = _aval(v)
        if v not in alone and aval.size * aval.dtype.itemsize <= PACKED_BYTES:
            groups.setdefault(aval.dtype, []).append(v)
    packs = [group for group in groups.values() if len(group) > 1]
    grouped = {v for group in packs for v in group}
    return [v for v in keep if v not in grouped], packs


NARROWING = frozenset(
    {"bitcast_convert_type", "broadcast_in_dim", "convert_element_type", "expand_dims"}
    | {"reshape", "slice", "squeeze"}
)
"""What turns PRF words into the randomness a protocol step uses (narrower words, its shape):
cheap enough to do again in each round that reads the result."""


def _stream_derived(eqns: list[JaxprEqn], randomness: _Randomness | None) -> dict[Var, JaxprEqn]:
    """The values made from PRF streams by `NARROWING` alone, with the equation making each.
    A round reading one makes it again from the keystream buffer instead of receiving it from
    the round that made it first: a round that draws the dealer's masks of every product
    would otherwise hand each of them on, and an executable with hundreds of outputs is
    slow to load (MLP step: 520 outputs, a 4 MB executable, 0.63 s)."""
    if randomness is None:
        return {}
    derived: dict[Var, JaxprEqn] = {}
    for eqn in eqns:
        ins = [v for v in eqn.invars if _is_var(v)]
        if (
            eqn.primitive.name in NARROWING
            and ins
            and all(v in randomness.index or v in derived for v in ins)
        ):
            derived.update((v, eqn) for v in eqn.outvars)
    return derived


def _made_by(derived: dict[Var, JaxprEqn], values: list[Var], made: set[Var]) -> list[JaxprEqn]:
    """The equations of `derived` that make `values` (but none of `made`), in order."""
    chain: dict[JaxprEqn, None] = {}

    def visit(v: Var) -> None:
        eqn = derived[v]
        if eqn in chain or v in made:
            return
        for u in eqn.invars:
            if _is_var(u) and u in derived:
                visit(u)
        chain[eqn] = None

    for v in values:
        visit(v)
    return list(chain)


BUFFER = "keystream"
"""The run's keystream buffer, held between rounds like a share program variable."""
SMALL_VIEW_WORDS = 16384
"""Streams of at most this many words (128 KiB) a round reads by one gather, each a row of
the widest one's length, and a slice of its row: two ops a view, not four (a slice and a
reshape of `STARTS` and a dynamic slice and reshape of the buffer). A bigger one is a dynamic
slice of its own, not a row read past its end."""
STARTS = "stream starts"
"""Where the streams a round reads start in the buffer: an input of the round, not constants
in its module, so that rounds doing the same work on other streams (the squarings of `exp`,
the iterations of a division) are the same function, written, planned and compiled once."""


class _Randomness:
    """Every PRF stream of a share program, drawn before the round that first needs them by
    one `mpplug.keystream` call (after a small PFunction gathers each stream's key) into one
    buffer of ChaCha20 blocks; each round slices the streams it reads from it.

    Where streams name the roles that use them, each role draws only its own streams (its
    row, picked by its role at run time): a stream two roles share costs nothing at the
    third. A role above every named one gets the last row: the streams every role uses."""

    def __init__(
        self, eqns: list[JaxprEqn], plan: RoundPlan, iteration: tuple[Var, int] | None
    ) -> None:
        self.iteration = iteration
        self.level = min(plan.level[i] for i, e in enumerate(plan.eqns) if e.primitive is prf_p)
        self.eqns = eqns
        self.plan_eqns = plan.eqns
        self.index = {e.outvars[0]: i for i, e in enumerate(eqns)}
        self.streams = [e.params["stream"] for e in eqns]
        self.shapes = [e.params["shape"] for e in eqns]
        self.counts = [blocks_for(shape) for shape in self.shapes]
        self.words = [math.prod(shape) for shape in self.shapes]
        small = [w for w in self.words if w <= SMALL_VIEW_WORDS]
        self.slack = -(-max(small, default=0) // BLOCK_WORDS_64)
        """Blocks of zeros after the streams, so that a round gathering its small views as
        rows of its widest one's length never reads past the buffer (a gather would clamp
        such a row back into it, onto other words)."""
        users = [e.params["roles"] for e in eqns]
        named = [u for u in users if u is not None]
        self.role: Any = None
        if named:
            self.role = next(e.invars[1] for e in eqns if e.params["roles"] is not None)
            self.rows = [
                [u is None or r in u for u in users] for r in range(2 + max(map(max, named)))
            ]
        else:
            self.rows = [[True] * len(eqns)]
        self.offsets = (stream_offsets(self.counts, self.rows) * BLOCK_WORDS_64).astype(np.int32)
        """Where each stream starts in each row's buffer, in words."""
        self.tables: list[np.ndarray] = []
        """The `STARTS` of the rounds recorded so far."""

    def record_draw(
        self,
        recording: Recording,
        types: list[jax.ShapeDtypeStruct],
        held: dict[Any, int],
        consts: dict[Var, Any],
        platforms: Sequence[str] | None,
    ) -> int:
        """Record the keys' PFunction and the keystream call; returns the buffer's value."""
        key_vars = [e.invars[0] for e in self.eqns]
        role_vars = [e.invars[1] for e in self.eqns if e.params["pick"] is not None]
        work = _dependencies(self.plan_eqns, [*key_vars, *role_vars])
        made = {v for e in work for v in e.outvars}
        inputs = list(
            dict.fromkeys(
                v
                for v in [*(r for e in work for r in e.invars), *key_vars, *role_vars]
                if _is_var(v) and v not in made and v not in consts
            )
        )

        def keys(ops: Any, *args: Any) -> tuple[Any]:
            env: dict[Any, Any] = dict(consts)
            env.update(zip(inputs, args, strict=True))
            for eqn in work:
                ops.bind(eqn, env)
            rows = []
            for e in self.eqns:
                key = _read(env, e.invars[0])
                if e.params["pick"] is not None:
                    key = picked_row(ops, key, _read(env, e.invars[1]), e.params["pick"])
                key = ops.convert_element_type(key, jnp.uint32)
                rows.append(ops.reshape(key, (1, KEY_WORDS)))
            return (ops.concatenate(rows, 0),)

        args = [held[v] for v in inputs]
        pfunc = _round_function(keys, "mpc.keys", [types[a] for a in args], platforms)
        (table,) = recording.call(pfunc, args)
        (out,) = tensor_outs(pfunc)
        types.append(jax.ShapeDtypeStruct(out.shape, out.dtype.numpy))
        stride = None if self.iteration is None else self.iteration[1]
        draw = keystream_pfunction(self.streams, self.counts, self.rows, stride, self.slack)
        args = [table, *([held[self.role]] if len(self.rows) > 1 else [])]
        if self.iteration is not None:
            args.append(held[self.iteration[0]])
        (buffer,) = recording.call(draw, args)
        (out,) = tensor_outs(draw)
        types.append(jax.ShapeDtypeStruct(out.shape, out.dtype.numpy))
        return buffer

    def small(self, views: Sequence[Var]) -> list[Var]:
        """Those of `views` of at most `SMALL_VIEW_WORDS` words."""
        return [v for v in views if self.words[self.index[v]] <= SMALL_VIEW_WORDS]

    def ordered(self, views: list[Var]) -> list[Var]:
        """`views` in the order a round reads them: the small ones first."""
        small = self.small(views)
        chosen = set(small)
        return small + [v for v in views if v not in chosen]

    def starts(self, views: Sequence[Var]) -> tuple[int, jax.ShapeDtypeStruct]:
        """The value a round reading `views` takes as its `STARTS` (each view's start in each
        row's buffer: int32[views], or int32[rows, views] where rows differ), and its type.
        The values are named -1, -2, ... until `record_rounds` prepends the one call that
        makes them all (`Recording.prepend_call`): a call each would cost every run a step
        per round."""
        table = self.offsets[:, [self.index[v] for v in views]]
        self.tables.append(table[0] if len(self.rows) == 1 else table)
        return -len(self.tables), jax.ShapeDtypeStruct(self.tables[-1].shape, np.int32)

    def read(self, env: dict[Any, Any], views: Sequence[Var], ops: Any) -> None:
        """Bind each stream of `views` in `env` to its words in the buffer, at the start
        `env[STARTS]` gives it (this role's row of them where rows differ)."""
        if not views:
            return
        starts = env[STARTS]
        if len(self.rows) > 1:
            role = ops.convert_element_type(_read(env, self.role), jnp.int32)
            row = ops.clamp(np.int32(0), role, np.int32(len(self.rows) - 1))
            starts = ops.dynamic_index_in_dim(starts, row, keepdims=False)
        small = self.small(views)
        if len(small) > 1:  # one gather of them all, as rows of the widest one's length
            width = max(self.words[self.index[v]] for v in small)
            at = starts if len(small) == len(views) else ops.slice(starts, (0,), (len(small),))
            rows = ops.gather_rows(env[BUFFER], ops.reshape(at, (len(small), 1)), width)
            for j, v in enumerate(small):
                words = ops.slice(rows, (j, 0), (j + 1, self.words[self.index[v]]))
                env[v] = ops.reshape(words, self.shapes[self.index[v]])
        else:
            small = []
        for j, v in enumerate(views[len(small) :], len(small)):
            start = ops.reshape(ops.slice(starts, (j,), (j + 1,)), ())
            env[v] = stream_view(env[BUFFER], start, self.shapes[self.index[v]], ops)


def _round_function(
    segment: Callable[..., tuple[Any, ...]],
    name: str,
    inputs: list[jax.ShapeDtypeStruct],
    platforms: Sequence[str] | None,
) -> PFunction:
    """A round's PFunction: written straight from its equations where `emit` writes each
    of them (no retrace, no lowering), else exported by `jax.export`."""
    if emitting():
        try:
            return emit.round_function(name, inputs, segment, platforms)
        except emit.Unemittable as exc:
            log.debug("%s: exported by jax.export (%s)", name, exc)

    def traced(*args: Any) -> tuple[Any, ...]:
        return segment(LAX, *args)

    traced.__name__ = name
    with jax.enable_x64(True):
        pfunc, _, _ = jax_export(traced, *inputs, platforms=platforms, disk=False)
    return pfunc


def emitting() -> bool:
    """Whether rounds are written by `emit` (`MPPLUG_EMIT=0`: every round is exported by
    `jax.export`, to compare the two)."""
    return os.environ.get("MPPLUG_EMIT", "1") != "0"


class LAX:
    """The calls a round's glue makes, as `lax` (traced by JAX); `emit.Builder` has the same."""

    slice = staticmethod(lax.slice)
    slice_in_dim = staticmethod(lax.slice_in_dim)
    reshape = staticmethod(lax.reshape)
    concatenate = staticmethod(lax.concatenate)
    bitcast_convert_type = staticmethod(lax.bitcast_convert_type)
    convert_element_type = staticmethod(lax.convert_element_type)
    clamp = staticmethod(lax.clamp)
    # clamped into range as XLA does, as `emit.Builder` writes them (jax's default wraps a
    # negative start first)
    dynamic_index_in_dim = staticmethod(
        functools.partial(lax.dynamic_index_in_dim, allow_negative_indices=False)
    )
    dynamic_slice_in_dim = staticmethod(
        functools.partial(lax.dynamic_slice_in_dim, allow_negative_indices=False)
    )
    bitwise_or = staticmethod(lax.bitwise_or)
    shift_left = staticmethod(lax.shift_left)

    @staticmethod
    def gather_rows(x: Any, starts: Any, width: int) -> Any:
        """Rows of `width` words of the vector `x` from each of `starts` (int32[rows, 1]),
        each start clamped into range."""
        dims = lax.GatherDimensionNumbers(
            offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,)
        )
        return lax.gather(x, starts, dims, (width,), mode=lax.GatherScatterMode.CLIP)

    @staticmethod
    def flat(x: Any) -> Any:
        return lax.reshape(x, (int(np.prod(np.shape(x))),))

    @staticmethod
    def bind(eqn: JaxprEqn, env: dict[Any, Any]) -> None:
        _bind(eqn, env)


def _segment(
    eqns: list[JaxprEqn],
    direct: list[Any],
    messages: list[Any],
    received: dict[Var, tuple[Any, int, int]],
    consts: dict[Var, Any],
    keep: list[Any],
    packs: list[list[Var]],
    sends: list[_Message],
    randomness: _Randomness | None,
    views: list[Var],
) -> Any:
    """The local work of one round as a function of the calls `ops` makes (`LAX` or an
    `emit.Builder`): (held values, vectors) -> (values kept for later rounds, one vector per
    group of `packs` kept for them, one vector per message sent); `views` are the PRF
    streams it reads from the keystream buffer; `received` are the values it reads from
    `messages` (received messages and kept vectors: message, start, size)."""
    slot = {m: i for i, m in enumerate(messages)}

    def segment(ops: Any, *args: Any) -> tuple[Any, ...]:
        env: dict[Any, Any] = dict(consts)
        env.update(zip(direct, args, strict=False))
        vectors = args[len(direct) :]
        for v, (index, start, size) in received.items():
            piece = ops.slice_in_dim(vectors[slot[index]], start, start + size)
            env[v] = ops.reshape(_reinterpreted(ops, piece, _aval(v).dtype), _aval(v).shape)
        if randomness is not None:
            randomness.read(env, views, ops)
        for eqn in eqns:
            ops.bind(eqn, env)

        def joined(values: list[Any], dtype: Any) -> Any:  # one flat vector of `dtype` words
            flat = [ops.flat(_read(env, v)) for v in values]
            return ops.concatenate([ops.flat(_reinterpreted(ops, x, dtype)) for x in flat], 0)

        kept = [_read(env, v) for v in keep]
        bundles = [joined(group, _aval(group[0]).dtype) for group in packs]
        out = [joined([e.invars[0] for e in m.eqns], m.dtype) for m in sends]
        return (*kept, *bundles, *out)

    return segment


def _reinterpreted(ops: Any, x: Any, dtype: Any) -> Any:
    """The flat `x` as `dtype` words of the same bits: a narrower type's words (one more
    axis), or a wider type's from narrower words read in order."""
    have, want = np.dtype(x.dtype), np.dtype(dtype)
    if have == want:
        return x
    if want.itemsize < have.itemsize:
        return ops.bitcast_convert_type(x, want)
    ratio = want.itemsize // have.itemsize
    return ops.bitcast_convert_type(ops.reshape(x, (x.shape[0] // ratio, ratio)), want)


def _dependencies(eqns: list[JaxprEqn], targets: list[Any]) -> list[JaxprEqn]:
    """The equations among `eqns` that `targets` depend on, in order."""
    needed = {v for v in targets if _is_var(v)}
    chosen = []
    for eqn in reversed(eqns):
        if any(v in needed for v in eqn.outvars):
            chosen.append(eqn)
            needed.update(v for v in eqn.invars if _is_var(v))
    return chosen[::-1]
