"""Logic on secret bits held as XOR shares of bit 0: XOR and NOT are local; AND is one round of
ABY3's boolean product (1 byte per element per party); AND and OR over an axis are trees of
ceil(log2 n) such rounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.secret import UNSUPPORTED_HINT, Secret, Value, broadcast_shares, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


def not_bit(self: Interpreter, bits: Shares) -> Shares:
    return self.protocol.xor_public(self.ctx, bits, jnp.uint64(1))


def require_bool(self: Interpreter, eqn: JaxprEqn) -> None:
    if out_aval(eqn).dtype != jnp.bool_:
        raise TraceError(
            f"{self.where}: bitwise {eqn.primitive.name} on secret integers is not supported "
            f"(only on bools); {UNSUPPORTED_HINT}"
        )


@rule("and", "or", "xor")
def _logic(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    require_bool(self, eqn)
    shape = out_aval(eqn).shape
    a, b = (broadcast_shares(s, shape) for s in map(self.boolean, values))
    if eqn.primitive.name == "xor":
        return self.out(eqn, a ^ b, boolean=True)
    both = self.protocol.and_(self.ctx, a, b, bits=1)
    return self.out(eqn, both if eqn.primitive.name == "and" else a ^ b ^ both, boolean=True)


@rule("reduce_and", "reduce_or")
def _reduce_logic(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """`jnp.all` / `jnp.any` over `axes`: an AND tree over XOR-shared bits, ceil(log2 n)
    rounds (OR as NOT AND NOT)."""
    require_bool(self, eqn)
    (x,) = values
    axes = tuple(eqn.params["axes"])
    kept = [d for d in range(len(x.shape)) if d not in axes]
    count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    is_or = eqn.primitive.name == "reduce_or"
    if count == 0:  # the empty AND is true, the empty OR false
        return jnp.full(out_aval(eqn).shape, not is_or)

    def flatten(s: jnp.ndarray) -> jnp.ndarray:
        moved = jnp.transpose(s, [*kept, *axes])
        return moved.reshape(*(x.shape[d] for d in kept), count)

    bits = self.protocol.local(flatten, self.boolean(x))
    if is_or:
        bits = not_bit(self, bits)
    while count > 1:
        half = count // 2
        low = self.protocol.local(lambda s, h=half: s[..., :h], bits)
        high = self.protocol.local(lambda s, h=half: s[..., h : 2 * h], bits)
        rest = self.protocol.local(lambda s, h=half: s[..., 2 * h :], bits)
        both = self.protocol.and_(self.ctx, low, high, bits=1)
        bits = self.protocol.local(lambda a, b: jnp.concatenate([a, b], axis=-1), both, rest)
        count = half + count % 2
    out = self.protocol.local(lambda s: s[..., 0], bits)
    return self.out(eqn, not_bit(self, out) if is_or else out, boolean=True)


@rule("not")
def _logical_not(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    require_bool(self, eqn)
    return self.out(eqn, not_bit(self, self.boolean(values[0])), boolean=True)
