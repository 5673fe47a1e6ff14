"""Control flow on shares.

`lax.scan` and a static `lax.fori_loop` with a public trip count run as loops of the share
program (see `loops`), or unrolled inside a loop's body: the body's cost times the trip count;
nothing is revealed by the loop itself.

`lax.cond` / `lax.switch` with a secret predicate or index evaluate every branch on the
operands and select each output by the secret (`comparison.choose`: 3 rounds for two branches,
11 for more), so the cost is every branch's plus the selection, and nothing tells which branch
was taken; branches are pure JAX, so there are no side effects to hide. A public index picks
its branch (a concrete one at trace time, otherwise by a local selection).

`lax.while_loop` is refused: a secret predicate would reveal the trip count (SPU refuses it
too), and a public one is not known when the share program is traced; a loop with a public
trip count is written with `lax.fori_loop` or `lax.scan` (with `jnp.where` for early exits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.comparison import choose
from mpplug.mpc.secret import UNSUPPORTED_HINT, Secret, Value, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


@rule("scan")
def _scan(it: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Value]:
    """`lax.scan`, and `lax.fori_loop` with a static trip count (which JAX writes as a scan):
    a loop of the share program (see `loops`), or unrolled inside a loop's body (the body
    runs `length` times on shares, one iteration after another)."""
    params = eqn.params
    body = params["jaxpr"]
    if not isinstance(body, ClosedJaxpr):  # JAX 0.11 passes a Jaxpr and "ft_in" counts
        body = ClosedJaxpr(body, ())
    counts = scan_counts(params)
    if counts is None:
        raise TraceError(
            f"{it.where}: lax.scan as JAX {jax.__version__} writes it (params "
            f"{sorted(params)}) is not supported yet; {UNSUPPORTED_HINT}"
        )
    if it.loops is not None and params["length"] > 0:
        return it.loops.scan(it, eqn, body, counts, values)
    n_consts, n_carry = counts
    consts = values[:n_consts]
    carry = list(values[n_consts : n_consts + n_carry])
    xs = values[n_consts + n_carry :]
    steps = range(params["length"])
    per_step: list[list[Value]] = []
    for t in reversed(steps) if params["reverse"] else steps:
        outs = it.eval(body.jaxpr, body.consts, [*consts, *carry, *(_row(it, x, t) for x in xs)])
        carry = outs[:n_carry]
        per_step.append(outs[n_carry:])
    if params["reverse"]:
        per_step.reverse()
    ys = [
        _stacked(it, [step[k] for step in per_step], out_aval(eqn, n_carry + k))
        for k in range(len(eqn.outvars) - n_carry)
    ]
    return [*carry, *ys]


def scan_counts(params: dict[str, Any]) -> tuple[int, int] | None:
    """(constants, carries) of a scan: JAX 0.10 names them, JAX 0.11 gives "ft_in", a tuple of
    (constants, carries, scanned) entries (None where that JAX left one out: unknown here)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    groups = params.get("ft_in")
    if isinstance(groups, tuple) and len(groups) == 3 and all(isinstance(g, tuple) for g in groups):
        return len(groups[0]), len(groups[1])
    return None


def _row(it: Interpreter, x: Value, t: int) -> Value:
    """Row `t` of a scanned-over value."""
    if not isinstance(x, Secret):
        return x[t]
    rows = it.protocol.local(lambda s: s[t], x.shares)
    return Secret(rows, x.shape[1:], x.dtype, x.boolean, x.wide)


def _stacked(it: Interpreter, rows: list[Value], aval: Any) -> Value:
    """A scan's per-iteration outputs stacked along a new first axis."""
    if not any(isinstance(r, Secret) for r in rows):
        return jnp.stack(rows) if rows else jnp.zeros(aval.shape, aval.dtype)
    boolean = all(isinstance(r, Secret) and r.boolean for r in rows)
    shares = [r.shares if boolean else it.arith(r, aval.dtype) for r in rows]
    stacked = it.protocol.local(lambda *parts: jnp.stack(parts), *shares)
    return Secret(stacked, tuple(aval.shape), np.dtype(aval.dtype), boolean)


@rule("cond")
def _cond(it: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Value]:
    index, *operands = values
    branches = eqn.params["branches"]
    if not isinstance(index, Secret | jax.core.Tracer):  # known now: only its branch
        branch = branches[int(np.clip(np.asarray(index), 0, len(branches) - 1))]
        return it.eval(branch.jaxpr, branch.consts, operands)
    outs = [it.eval(b.jaxpr, b.consts, operands) for b in branches]
    results: list[Value] = []
    for k in range(len(eqn.outvars)):
        aval = out_aval(eqn, k)
        cases = [branch[k] for branch in outs]
        if not isinstance(index, Secret) and not any(isinstance(c, Secret) for c in cases):
            results.append(lax.select_n(index, *cases))
            continue
        shares = [it.arith(c, aval.dtype, aval.shape) for c in cases]
        if isinstance(index, Secret):
            picked = choose(it, index, shares, aval.shape)
        else:
            picked = it.protocol.local(lambda *parts: lax.select_n(index, *parts), *shares)
        results.append(Secret(picked, tuple(aval.shape), np.dtype(aval.dtype)))
    return results


@rule("while")
def _while(it: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Value]:
    raise TraceError(
        f"{it.where}: lax.while_loop on secrets is not supported: a secret predicate would "
        f"reveal the number of iterations, and a public one is not known when the program "
        f"is traced; give the loop a public trip count (lax.fori_loop with constant bounds, "
        f"or lax.scan) and select with jnp.where inside the body, or reveal the predicate "
        f"and loop around mp.mpc.run with mp.while_loop"
    )
