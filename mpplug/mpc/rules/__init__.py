"""Secure rules, one module per family of JAX primitives, each stating its protocol and its
cost; a rule maps (interpreter, equation, operand values) to the equation's output values.

Families: `arithmetic`, `comparison`, `bits`, `approximations`, `structure`, `control`,
`selection` (reductions to an extremum, sort), `indexing` (secret indices) and `convolution`.
Importing `mpplug.mpc.interpreter` registers them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jax.extend.core import JaxprEqn

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter

Rule = Callable[["Interpreter", JaxprEqn, list[Any]], Any]
RULES: dict[str, Rule] = {}
"""JAX primitive name -> its secure rule."""
NAMED_FUNCTIONS: dict[str, Callable[..., Any]] = {}
"""jnp functions whose JAX body a secret cannot take (it reads a float's bits), by the name
of the jit JAX wraps them in -> the same function as plain JAX the rules cover."""


def rule(*names: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the secure rule of the primitives `names`."""

    def register(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn

    return register
