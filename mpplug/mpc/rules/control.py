"""Control flow on shares: `lax.scan` and a static `lax.fori_loop` with a public trip count run as
loops of the share program (see `loops`), or unrolled inside a loop's body. Costs are the
body's times the trip count; nothing is revealed by the loop itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc.rules import rule
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
    return Secret(it.protocol.local(lambda s: s[t], x.shares), x.shape[1:], x.dtype, x.boolean)


def _stacked(it: Interpreter, rows: list[Value], aval: Any) -> Value:
    """A scan's per-iteration outputs stacked along a new first axis."""
    if not any(isinstance(r, Secret) for r in rows):
        return jnp.stack(rows) if rows else jnp.zeros(aval.shape, aval.dtype)
    boolean = all(isinstance(r, Secret) and r.boolean for r in rows)
    shares = [r.shares if boolean else it.arith(r, aval.dtype) for r in rows]
    stacked = it.protocol.local(lambda *parts: jnp.stack(parts), *shares)
    return Secret(stacked, tuple(aval.shape), np.dtype(aval.dtype), boolean)
