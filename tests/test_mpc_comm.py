"""What MPC costs in communication, read from the program and counted on the wire.

Rounds come from the program graph (`round_depth`: the longest chain of SHUFFLEs moving an
`mpc.*` round's output); bytes are the payloads each party received during one evaluation
(`RecordingSimulator`, tests/mpc_views.py), counting round messages only: the seal before and
the reveal after are the same for every computation.

ABY3 costs per output element: a product reshares one ring element (8 bytes) to every party
in one round; a fixed-point product with precise truncation (the default) takes three rounds
in which each role sends 12 bytes (role 2 deals, roles 0 and 1 receive); with probabilistic
truncation, one reshare round and one round in which role 0 alone receives 8 bytes; a 64-bit
comparison takes at most 10 rounds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpplug as mp
from bench.mpc import comm_stats

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


def _sealed(fn: Any, truncation: str) -> Any:
    """A program that seals two inputs, runs `fn` on them and keeps the result sealed."""

    @mp.function
    def program(x: Any, y: Any) -> Any:
        a, b = mp.mpc.seal((x, y), truncation=truncation)
        return mp.mpc.run(fn, a, b)

    return program


def measure(
    fn: Any, x: np.ndarray, y: np.ndarray, truncation: str = "precise"
) -> tuple[int, dict[int, int], dict[int, int]]:
    """(rounds, round-message bytes received per party, round messages received per party)
    for `fn` on x and y."""
    program_fn = _sealed(fn, truncation)
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


NARROW_BYTES = 4  # the truncation's masked wrap bits and dealer correction travel as u32


def test_fixed_point_mul_with_precise_truncation_is_three_rounds_of_12_bytes_per_role():
    rounds, received, messages = measure(lambda a, b: a * b, *REALS)
    assert rounds == 3
    # role 1 receives role 2's half of the product with the dealer's correction (round 1,
    # one message), role 0's masked bit (round 2) and role 0's reshare (round 3); role 0
    # receives role 1's masked bit and reshare; role 2 only deals
    assert messages == {0: 2, 1: 3, 2: 0}
    assert received == {
        0: (NARROW_BYTES + RING_BYTES) * N,
        1: (2 * RING_BYTES + 2 * NARROW_BYTES) * N,
        2: 0,
    }
    assert sum(received.values()) == 3 * 12 * N  # each role sends 12 bytes per element


def test_fixed_point_mul_with_probabilistic_truncation_is_a_reshare_and_a_truncation_round():
    rounds, received, messages = measure(lambda a, b: a * b, *REALS, truncation="probabilistic")
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
    assert rounds == 3
    assert messages == {0: 2, 1: 3, 2: 0}  # both dots' messages of a round travel as one
    assert received == {
        0: (NARROW_BYTES + RING_BYTES) * outputs,
        1: (2 * RING_BYTES + 2 * NARROW_BYTES) * outputs,
        2: 0,
    }


def test_a_32_bit_comparison_is_one_sign_8_rounds_and_254_bits():
    rounds, received, messages = measure(lambda a, b: a < b, *(v.astype(np.int32) for v in INTS))
    assert rounds == 8
    assert messages == {0: rounds, 1: rounds, 2: rounds}  # one AND reshare per round
    # the AND reshares narrow with the Kogge-Stone levels: 64, 64, 64, 32, 16 and 8 bits an
    # element, then 4 and 2 bits packed two and four to a byte (the last byte padded): 254
    # bits an element per party, the protocol's documented cost (aby3.py)
    packed = -(-N // 2) + -(-N // 4)
    assert received == dict.fromkeys(range(3), (8 + 8 + 8 + 4 + 2 + 1) * N + packed)


def test_a_32_bit_sum_is_wrapped_once_before_a_comparison_and_a_64_bit_one_never():
    """A sum JAX wraps at 32 bits is wrapped (its 32 low bits weighed back, 9 rounds) before a
    comparison reads it, once for every read; sealed values are within range and a 64-bit sum
    wraps with the ring, so neither pays for it."""
    narrow = [v.astype(np.int32) for v in INTS]
    compared, _, _ = measure(lambda a, b: a < b, *narrow)
    wrapped, _, _ = measure(lambda a, b: (a + b) < b, *narrow)
    twice, _, _ = measure(lambda a, b: ((a + b) < b) & ((a + b) > a), *narrow)
    assert (compared, wrapped) == (8, 9 + 8)
    assert twice == 9 + 8 + 1  # one wrap for both comparisons, then their AND
    assert measure(lambda a, b: (a + b) < b, *INTS)[0] == 9


def test_a_loop_wraps_a_narrow_carry_only_where_its_body_makes_it_wide():
    """A 32-bit carry that an iteration only compares and selects stays in range, so its
    next comparison takes no wrap (11 rounds an iteration: a sign and a selection); one the
    body sums is wrapped before each next comparison (9 rounds more, beside the other sum's
    bit made a number), and comes out as JAX's."""

    def selecting(a: Any, b: Any) -> Any:
        return lax.fori_loop(0, 4, lambda t, c: (jnp.where(c[0] < c[1], c[0], c[1]), c[1]), (a, b))

    def summing(a: Any, b: Any) -> Any:
        return lax.fori_loop(0, 4, lambda t, c: (c[0] + c[1], c[1] + (c[0] < c[1])), (a, b))

    a = np.array([2**31 - 9, -5, 7, 0], np.int32)
    b = np.array([2**30, 3, -(2**31), 9], np.int32)
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        x, y = sim.put(0, a), sim.put(1, b)
        rounds = [
            comm_stats(sim.compile(_revealed(fn), x, y).graph, 3).shuffles
            for fn in (selecting, summing)
        ]
        got = [sim.fetch(sim.evaluate(_revealed(fn), x, y), party=0) for fn in (selecting, summing)]
    assert rounds == [4 * (8 + 3), 4 * (9 + 8 + 2)]
    for fn, values in zip((selecting, summing), got, strict=True):
        for value, want in zip(values, jax.jit(fn)(a, b), strict=True):
            np.testing.assert_array_equal(value, want)


def test_a_64_bit_comparison_is_three_signs_and_one_and_9_rounds():
    # exact over the whole int64 range: signs of a, b and a - b in one batch, one AND more
    rounds, received, messages = measure(lambda a, b: a < b, *INTS)
    assert rounds == 9
    assert messages == {0: rounds, 1: rounds, 2: rounds}
    for party in range(3):
        assert 33 * N < received[party] <= (3 * 33 + 1) * N, (party, received[party])


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


def test_the_quotient_and_remainder_of_the_same_operands_share_one_long_division():
    """`div` and `rem` of the same secret integers (as `//` and `divmod` write them) cost
    what `div` alone costs, rounds and bytes, and both come out right."""
    x = np.array([17, -17, 9, 2**31 - 1, 0], np.int32)
    y = np.array([5, 5, -4, 3, 7], np.int32)

    def quotient(a: Any, b: Any) -> Any:
        return lax.div(a, b)

    def both(a: Any, b: Any) -> Any:
        return lax.div(a, b), lax.rem(a, b)

    costs = []
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        a, b = sim.put(0, x), sim.put(1, y)
        for fn in (quotient, both):
            program = _revealed(fn)
            stats = comm_stats(sim.compile(program, a, b).graph, 3)
            costs.append((stats.shuffles, stats.bytes_sent))
        q, r = sim.fetch(sim.evaluate(_revealed(both), a, b), party=0)
    assert costs[0] == costs[1]
    assert costs[0][0] > 100  # a long division: one step a bit
    np.testing.assert_array_equal(q, lax.div(x, y))
    np.testing.assert_array_equal(r, lax.rem(x, y))


def _revealed(fn: Any) -> Any:
    @mp.function
    def program(x: Any, y: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(fn, *mp.mpc.seal((x, y))), to=0)

    return program


def test_each_products_dealing_travels_in_its_own_round_so_longer_chains_add_no_function():
    """A precise truncation's dealer correction needs nothing received; it travels with the
    product's half in the round before it is used (one message, of two element types), not
    in the first round with every other product's. So a chain of twelve products is made
    of the functions a chain of two is (the rounds repeat, none grows), and is right."""

    def chain(k: int) -> Any:
        def fn(a: Any, b: Any) -> Any:
            for _ in range(k):
                a = a * b * 0.5
            return a

        return fn

    x, y = np.float32([1.5, -2.0, 3.0, 0.25]), np.float32([1.25, 0.75, -1.5, 2.0])
    made = []
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        a, b = sim.put(0, x), sim.put(1, y)
        for k in (2, 12):
            program = _revealed(chain(k))
            functions = {f.digest: f for f in sim.compile(program, a, b).graph.functions}
            rounds = [f for f in functions.values() if f.fn_name.startswith("mpc.trunc")]
            made.append((len(functions), sorted((f.fn_name, len(f.outs_info)) for f in rounds)))
            assert max(len(f.fn_body) for f in rounds) < 4000
            got = sim.fetch(sim.evaluate(program, a, b), party=0)
            np.testing.assert_allclose(got, chain(k)(x.astype(np.float64), y), rtol=1e-3, atol=1e-4)
    assert made[0] == made[1]
    assert ("mpc.trunc.pair+trunc.dealer", 2) in made[1][1]


def test_a_round_hands_on_its_small_values_in_one_vector_per_type():
    """Ten products computed together and read rounds later leave their round as one vector
    (per element type) that the later rounds slice, not as ten outputs, and come out right."""

    def products(a: Any, b: Any) -> Any:
        p = [a * (b + i) for i in range(10)]
        q = [x * 0.5 for x in p]  # a round later, each p is read again below
        return sum(x * y for x, y in zip(p, q, strict=True))

    x, y = np.float32([1.5, -2.0, 0.25]), np.float32([0.5, 0.75, -1.0])
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        a, b = sim.put(0, x), sim.put(1, y)
        program = _revealed(products)
        graph = sim.compile(program, a, b).graph
        got = sim.fetch(sim.evaluate(program, a, b), party=0)
    rounds = [f for f in graph.functions if f.fn_name.startswith("mpc.")]
    widest = max(rounds, key=lambda f: len(f.outs_info))
    assert len(widest.outs_info) <= 6, (widest.fn_name, widest.outs_info)
    want = sum(x * (y + i) * x * (y + i) * 0.5 for i in range(10))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
