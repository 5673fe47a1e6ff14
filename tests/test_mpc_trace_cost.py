"""What a secure program costs to trace: the equations of its share program, each of which
is traced, scheduled, written into a round and compiled (or planned) before the first run."""

from __future__ import annotations

import collections
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export

import mpplug as mp
from mpplug.core.graph import OpKind
from mpplug.mpc import api, spliced

PRODUCT_EQUATIONS = 61
"""A fixed-point product with precise truncation: the products of shares, three rounds of
exchanges, six PRF draws, and the selects that differ by role (74, and ten nested jits, when
shares were read with jnp indexing and roles chosen with jnp.where)."""


def _share_programs(monkeypatch: pytest.MonkeyPatch) -> list[collections.Counter[str]]:
    """The primitives of every share program traced from now on (its steps inlined), counted."""
    seen: list[collections.Counter[str]] = []
    record = api.record_rounds

    def counting(program: Any, avals: Any, platforms: Any, **kwargs: Any) -> Any:
        inlined = spliced.inline(program)
        seen.append(collections.Counter(e.primitive.name for e in inlined.jaxpr.eqns))
        return record(program, avals, platforms, **kwargs)

    monkeypatch.setattr(api, "record_rounds", counting)
    return seen


def _products(n: int) -> Any:
    @mp.function
    def program(x: Any, y: Any) -> Any:
        a, b = mp.mpc.seal((x, y))

        def chain(a: Any, b: Any) -> Any:
            for _ in range(n):
                a = a * b
            return a

        return mp.mpc.reveal(mp.mpc.run(chain, a, b), to=0)

    return program


def test_a_fixed_point_product_traces_to_a_bounded_number_of_plain_equations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))  # traced here, not read from disk
    seen = _share_programs(monkeypatch)
    x = np.linspace(-2, 2, 4, dtype=np.float32)
    y = np.linspace(0.5, 3, 4, dtype=np.float32)
    with mp.Simulator(3) as sim:
        xs, ys = sim.put(0, x), sim.put(1, y)
        outs = [sim.fetch(sim.evaluate(_products(n), xs, ys), party=0) for n in (1, 3)]
    np.testing.assert_allclose(outs[0], x * y, atol=1e-4)
    np.testing.assert_allclose(outs[1], x * y**3, atol=1e-3)
    one, three = seen
    per_product = (sum(three.values()) - sum(one.values())) // 2
    assert per_product <= PRODUCT_EQUATIONS, (per_product, three - one)
    assert "jit" not in three, three  # no jnp function traced as a nested jaxpr
    assert three["eq"] == 1, three  # the party's role is tested once per share program


def _round_calls(fn: Any) -> tuple[int, int]:
    """How many calls of round functions a secure `fn` of a 4-vector makes, and how many
    distinct round functions they call."""

    @mp.function
    def program(x: Any) -> Any:
        (a,) = mp.mpc.seal((x,))
        return mp.mpc.reveal(mp.mpc.run(fn, a), to=0)

    graph = mp.compile(program, mp.MPObject(mp.TensorType("float32", (4,)), {0}), world_size=3)
    graph = graph.graph
    rounds = [
        op.function
        for op in graph.ops
        if op.kind is OpKind.CALL and graph.functions[op.function].fn_name.startswith("mpc.")
    ]
    return len(rounds), len(set(rounds))


def test_rounds_that_differ_only_in_their_streams_are_one_function(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a round reads its PRF streams in the run's keystream buffer is an input of the
    round, not constants in its module: exp's squarings call the functions of one squaring
    again (29 distinct round functions when the starts were constants)."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))
    calls, functions = _round_calls(jnp.exp)
    assert functions <= 16 < calls, (calls, functions)


def test_a_round_reads_its_small_streams_with_one_gather(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round takes the PRF streams it reads (at most `SMALL_VIEW_WORDS` words each) as
    rows of one gather of the keystream buffer, then a slice and a reshape each: no dynamic
    slice of the buffer a stream (with a slice and a reshape of its start before it)."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))

    @mp.function
    def program(x: Any, y: Any) -> Any:
        a, b = mp.mpc.seal((x, y))
        return mp.mpc.reveal(mp.mpc.run(lambda a, b: a * b * b, a, b), to=0)

    spec = mp.MPObject(mp.TensorType("float32", (4,)), {0})
    graph = mp.compile(program, spec, spec, world_size=3).graph
    gathers = buffer_slices = 0
    for pfunc in graph.functions:
        if not pfunc.fn_name.startswith("mpc."):
            continue
        text = jax_export.deserialize(bytearray(pfunc.fn_body)).mlir_module()
        gathers += text.count("stablehlo.gather")
        buffer_slices += len(re.findall(r"stablehlo\.dynamic_slice.*\(tensor<\d+xui64>", text))
    assert gathers >= 2 and buffer_slices == 0, (gathers, buffer_slices)
