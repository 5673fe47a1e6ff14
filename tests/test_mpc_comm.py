"""What MPC costs in communication, read from the program and counted on the wire.

Rounds come from the program graph (`round_depth`: the longest chain of SHUFFLEs moving an
`mpc.*` round's output); bytes are the payloads each party received during one evaluation
(`RecordingSimulator`, tests/mpc_views.py), counting round messages only: the seal before and
the reveal after are the same for every computation.

ABY3 costs per output element: a product reshares one ring element (8 bytes) to every party
in one round; a fixed-point product then truncates, one more round in which role 0 alone
receives 8 bytes; a 64-bit comparison takes at most 10 rounds.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

import mpplug as mp

from .mpc_views import (
    ROUND,
    RecordingSimulator,
    classify,
    expected_receptions,
    of_kind,
    round_depth,
)

TIMEOUT = 180.0
RING_BYTES = 8


def _sealed(fn: Any) -> Any:
    """A program that seals two inputs, runs `fn` on them and keeps the result sealed."""

    @mp.function
    def program(x: Any, y: Any) -> Any:
        a, b = mp.mpc.seal((x, y))
        return mp.mpc.run(fn, a, b)

    return program


def measure(fn: Any, x: np.ndarray, y: np.ndarray) -> tuple[int, dict[int, int], dict[int, int]]:
    """(rounds, round-message bytes received per party, round messages received per party)
    for `fn` on x and y."""
    program_fn = _sealed(fn)
    with RecordingSimulator(3, timeout=TIMEOUT) as sim:
        a, b = sim.put(0, x), sim.put(1, y)
        program = sim.compile(program_fn, a, b)
        _, received = sim.evaluate_recorded(program_fn, a, b)
    counts = {p: 0 for p in range(3)}
    for message in received:
        counts[message.dst] += 1
    assert counts == {p: expected_receptions(program).get(p, 0) for p in range(3)}, (
        "the recorder missed values the program sends"
    )
    per_party = {p: 0 for p in range(3)}
    messages = {p: 0 for p in range(3)}
    for message in of_kind(program, received, ROUND):
        per_party[message.dst] += message.nbytes
        messages[message.dst] += 1
    return round_depth(program), per_party, messages


N = 10
RNG = np.random.default_rng(1)
REALS = RNG.uniform(-4, 4, N), RNG.uniform(-4, 4, N)
INTS = RNG.integers(-(2**40), 2**40, N), RNG.integers(-(2**40), 2**40, N)


def test_fixed_point_mul_is_a_reshare_round_and_a_truncation_round():
    rounds, received, messages = measure(lambda a, b: a * b, *REALS)
    assert rounds == 2
    assert messages == {0: 2, 1: 1, 2: 1}
    # reshare: every party receives one ring element per output element from the next role;
    # truncation: role 0 (party 0) receives one more from role 1
    assert received == {0: 2 * RING_BYTES * N, 1: RING_BYTES * N, 2: RING_BYTES * N}


def test_integer_mul_is_exactly_one_round():
    rounds, received, messages = measure(lambda a, b: a * b, *INTS)
    assert rounds == 1
    assert messages == {0: 1, 1: 1, 2: 1}
    assert received == {0: RING_BYTES * N, 1: RING_BYTES * N, 2: RING_BYTES * N}


def test_dot_sends_one_ring_element_per_output_whatever_the_inner_dimension():
    # (2, 5) @ (5, 2) and (1, 10) @ (10, 3): 7 outputs, not 2*2*5 + 1*3*10 products
    def dots(a: Any, b: Any) -> Any:
        wide = jnp.broadcast_to(b[:, None], (N, 3))
        return a.reshape(2, 5) @ b.reshape(5, 2), a.reshape(1, N) @ wide

    rounds, received, messages = measure(dots, *REALS)
    outputs = 2 * 2 + 1 * 3
    assert rounds == 2
    assert messages == {0: 2, 1: 1, 2: 1}  # both dots' reshares travel as one message
    assert received == {
        0: 2 * RING_BYTES * outputs,
        1: RING_BYTES * outputs,
        2: RING_BYTES * outputs,
    }


def test_a_64_bit_comparison_takes_at_most_10_rounds():
    rounds, received, messages = measure(lambda a, b: a < b, *INTS)
    assert 1 <= rounds <= 10
    assert messages == {0: rounds, 1: rounds, 2: rounds}  # one AND reshare per round
    # the AND reshares narrow with the Kogge-Stone levels: at most 264 bits an element per
    # party, the protocol's documented cost (aby3.py)
    for party in range(3):
        assert 0 < received[party] <= 33 * N, (party, received[party])


def test_linear_work_sends_nothing():
    rounds, received, messages = measure(
        lambda a, b: jnp.concatenate([a + b * 2 - a[::-1], a.sum(keepdims=True)]), *INTS
    )
    assert rounds == 0
    assert received == messages == {0: 0, 1: 0, 2: 0}


def test_a_party_outside_the_computing_set_receives_nothing_of_the_rounds():
    @mp.function
    def program(x: Any, y: Any) -> Any:
        a, b = mp.mpc.seal((x, y), parties=[0, 1, 2])
        return mp.mpc.reveal(mp.mpc.run(lambda u, v: u * v, a, b), to=0)

    x, y = np.arange(5, dtype=np.int64), np.arange(5, dtype=np.int64) - 2
    with RecordingSimulator(4, timeout=TIMEOUT) as sim:
        a, b = sim.put(3, x), sim.put(0, y)
        compiled = sim.compile(program, a, b)
        out, received = sim.evaluate_recorded(program, a, b)
        np.testing.assert_array_equal(sim.fetch(out, party=0), x * y)
    assert round_depth(compiled) == 1
    assert not [m for m in received if m.dst == 3], "party 3 only sends (its seal)"
    sent_by_3 = [classify(compiled, m) for m in received if m.src == 3]
    assert sent_by_3 == ["seal"] * 3  # one share pair to each computing party
