"""What a party sees: every value each party receives during MPC programs, on the Simulator.

`RecordingSimulator` (tests/mpc_views.py) logs the payload of every value a party receives.
For a secure millionaire (x < y on int64 vectors, revealed to party 0), a secure fixed-point
matmul (revealed to party 1) and fixed-point products under both truncations, each input pair
is sealed 24 times and the computation then runs 24 times on the last sealing's shares, for
two secrets A and B:

- the protocol's round messages (every `mpc.*` round: the comparison's AND reshares, whatever
  their width, the product's reshare or its half sent to role 1, the precise truncation's
  masked wrap bits, dealer correction and reshare, the probabilistic truncation's masked
  share) are uniform bytes for a fixed secret and
  fixed shares: a chi-square test over the 256 byte values, and one over the 64 bit positions
  of the u64 words, each with p > P_MIN; no message repeats from one run to the next more
  often than chance (a binomial test per message over the runs, p > P_MIN). A
  message that is a function of the shares alone (a missing zero-share mask, a truncation
  sent unmasked, PRF keys that do not change) fails these, as checked by hand;
- the seal's share pairs are uniform bytes in the same way, over the 24 sealings;
- the byte histograms do not depend on the secret: a two-sample chi-square test of secret A
  against secret B has p > P_MIN;
- no value a party receives holds another party's input (its 8-byte ring encoding);
- after `reveal(x, to=k)` only party k holds the result, and no message carried it;
- two evaluations share the same inputs afresh, and the shares still add up.

Not tested for uniformity: the reveal's own message (party k must learn the output from it;
for a comparison it is a 0/1 share) and the PRF keys passed at setup (fresh prand words). With
about 150 distribution tests and 435 freshness tests (one per message of a run), each failing
a correct protocol with probability at most P_MIN = 1e-6, a run fails with probability < 6e-4
(less: a freshness test's discrete tail rarely reaches P_MIN).
test_a_chi_square_test_this_strong_sees_a_biased_view and
test_freshness_fails_a_message_that_does_not_change_and_passes_chance_repeats show they are
not vacuous, and test_a_truncation_with_a_broken_mask_fails_the_views that they catch a broken
mask.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import mpplug as mp
from mpplug.kernels.runtime import LRUCache
from mpplug.mpc import spliced

from .mpc_views import REVEAL, ROUND, SEAL, Received, RecordingSimulator, classify, payload

P_MIN = 1e-6
EVALUATIONS = 24
TIMEOUT = 180.0
F = mp.mpc.DEFAULT_FRAC_BITS


def encode(x: Any) -> np.ndarray:
    """Fixed-point ring words of reals, as `seal` makes them."""
    return np.round(np.asarray(x, np.float64) * 2.0**F).astype(np.int64)


@mp.function
def seal_both(x: Any, y: Any) -> Any:
    return mp.mpc.seal((x, y))


@mp.function
def millionaire(a: Any, b: Any) -> Any:
    return mp.mpc.reveal(mp.mpc.run(lambda x, y: x < y, a, b), to=0)


@mp.function
def matmul(a: Any, b: Any) -> Any:
    return mp.mpc.reveal(mp.mpc.run(lambda u, v: u @ v, a, b), to=1)


def sort_index_branch(x: Any, i: Any) -> Any:
    """A sort's swaps, a read at secret indices and a secret branch: what they do depends on
    the secrets, what a party receives must not."""
    branch = jax.lax.cond(x[0] > 0, lambda v: v * 2.0, lambda v: -v, x)
    return jnp.sort(x), x[i], branch


@mp.function
def selections(a: Any, b: Any) -> Any:
    return mp.mpc.reveal(mp.mpc.run(sort_index_branch, a, b), to=0)


def sealing(truncation: str) -> Any:
    @mp.function
    def seal(x: Any, y: Any) -> Any:
        return mp.mpc.seal((x, y), truncation=truncation)

    return seal


@mp.function
def product(a: Any, b: Any) -> Any:
    return mp.mpc.reveal(mp.mpc.run(lambda u, v: u * v, a, b), to=0)


def byte_histogram(data: bytes) -> np.ndarray:
    return np.bincount(np.frombuffer(data, np.uint8), minlength=256)


def uniform_bytes_p(data: bytes) -> float:
    counts = byte_histogram(data)
    return float(stats.chisquare(counts).pvalue)


def uniform_bits_p(words: np.ndarray) -> float:
    """p-value of 'each of the 64 bit positions is 1 half the time' over u64 `words`."""
    bits = (words[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    ones = bits.sum(axis=0).astype(np.float64)
    n = len(words)
    z2 = (ones - n / 2) ** 2 / (n / 4)
    return float(stats.chi2.sf(z2.sum(), df=64))


def same_distribution_p(a: bytes, b: bytes) -> float:
    """p-value of 'a and b are drawn from one byte distribution' (two-sample chi-square)."""
    table = np.stack([byte_histogram(a), byte_histogram(b)])
    return float(stats.chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue)


def views(
    sim: RecordingSimulator, compute: Any, x: Any, y: Any, seal: Any = seal_both
) -> tuple[Any, dict[str, dict[int, list[Received]]]]:
    """What each party receives, by kind, while x and y are sealed EVALUATIONS times and then
    `compute` runs EVALUATIONS times on the last sealing's shares: its round messages come
    from the same secret *and the same shares* each time, so only the protocol's fresh
    randomness (PRF keys drawn per evaluation) can make them differ."""
    seen: dict[str, dict[int, list[Received]]] = {}

    def record(fn: Any, *args: Any) -> Any:
        program = sim.compile(fn, *args)
        out, received = sim.evaluate_recorded(fn, *args)
        for message in received:
            kind = classify(program, message)
            seen.setdefault(kind, {}).setdefault(message.dst, []).append(message)
        return out

    for _ in range(EVALUATIONS):
        sealed = record(seal, x, y)
    for _ in range(EVALUATIONS):
        out = record(compute, *sealed)
    return out, seen


def check_fresh(name: str, messages: list[Received]) -> list[str]:
    """Failures where a round message repeats from one evaluation to the next (same shares)
    more often than chance: for each message of the program, the elements equal to the same
    message's in the evaluation before, over all EVALUATIONS, against the binomial tail of
    chance (each equal with probability 2^-bits), at P_MIN. A message that does not change
    fails at any size (a 1-element bool one: 2^-23); a uniform one of two bytes, equal twice
    in a row by chance once in 65,536 pairs, does not."""
    runs: dict[str, list[Received]] = {}
    for m in messages:
        runs.setdefault(m.exec_id, []).append(m)
    evaluations = list(runs.values())
    first = evaluations[0]
    for later in evaluations[1:]:
        assert [(m.op, m.src) for m in later] == [(m.op, m.src) for m in first]
    failures = []
    for at, message in enumerate(first):
        equal = total = 0
        for before, after in itertools.pairwise(evaluations):
            equal += int(np.count_nonzero(before[at].value == after[at].value))
            total += before[at].value.size
        bits = 1 if message.value.dtype == np.bool_ else 8 * message.value.dtype.itemsize
        if (p := float(stats.binom.sf(equal - 1, total, 2.0**-bits))) <= P_MIN:
            failures.append(
                f"{name}: message of op {message.op} repeats ({equal} of {total} elements "
                f"equal to the evaluation before, p = {p:.2g})"
            )
    return failures


def check_uniform(name: str, messages: list[Any]) -> list[str]:
    """Failures of the byte and bit tests over `messages` (bit test on the u64 ones)."""
    data = payload(messages)
    failures = []
    assert len(data) >= 256 * 20, f"{name}: too few bytes ({len(data)}) for the test"
    if (p := uniform_bytes_p(data)) <= P_MIN:
        failures.append(f"{name}: bytes not uniform (p = {p:.2g}, {len(data)} bytes)")
    words = np.concatenate([m.value.reshape(-1) for m in messages if m.value.dtype == np.uint64])
    if len(words) >= 1000 and (p := uniform_bits_p(words)) <= P_MIN:
        failures.append(f"{name}: u64 bits not uniform (p = {p:.2g}, {len(words)} words)")
    return failures


def _words(value: Any) -> list[bytes]:
    return [np.int64(v).tobytes() for v in np.asarray(value).reshape(-1)]


def check_views(case: str, secrets: dict[str, Any], seen: dict[str, dict[str, Any]]) -> None:
    """Everything a view must satisfy, for secrets A and B of one computation.

    `secrets[name]` maps each owner to its input words; `seen[name]` is what `views` gave.
    """
    failures = []
    for kind in (ROUND, SEAL):
        # with two owners, every party receives some other owner's shares; a round's
        # receivers are the protocol's to choose (role 2 of a precise truncation only deals)
        parties = range(3) if kind == SEAL else sorted(seen["A"].get(kind, {}))
        assert parties, f"{case}: no {kind} messages"
        for party in parties:
            a = seen["A"].get(kind, {}).get(party, [])
            b = seen["B"].get(kind, {}).get(party, [])
            assert a and b, f"{case}: party {party} received no {kind} messages"
            failures += check_uniform(f"{case} {kind} at party {party}, secret A", a)
            failures += check_uniform(f"{case} {kind} at party {party}, secret B", b)
            if (p := same_distribution_p(payload(a), payload(b))) <= P_MIN:
                failures.append(f"{case} {kind} at party {party}: A and B differ (p = {p:.2g})")
            if kind == ROUND:
                failures += check_fresh(f"{case} round at party {party}", a)
    for name in ("A", "B"):
        for kind, by_party in seen[name].items():
            for party, messages in by_party.items():
                data = payload(messages)
                for owner, words in secrets[name].items():
                    if owner != party and any(w in data for w in words):
                        failures.append(
                            f"{case} {name}: party {party} received party {owner}'s input in "
                            f"{kind} messages"
                        )
    assert not failures, "\n".join(failures)


def test_millionaire_views_are_uniform_secret_independent_and_free_of_inputs():
    """Secret A: x < y everywhere; secret B: other values, x > y everywhere."""
    rng = np.random.default_rng(3)
    seen, secrets = {}, {}
    with RecordingSimulator(3, timeout=TIMEOUT) as sim:
        for name, sign in (("A", 1), ("B", -1)):
            x = rng.integers(-(2**40), 2**40, 64, dtype=np.int64)
            y = x + sign * rng.integers(1, 2**30, 64, dtype=np.int64)
            out, seen[name] = views(sim, millionaire, sim.put(0, x), sim.put(1, y))
            at_0, at_1, at_2 = sim.fetch(out)
            assert at_1 is None and at_2 is None
            np.testing.assert_array_equal(at_0, x < y)
            secrets[name] = {0: _words(x), 1: _words(y)}
    assert sorted(seen["A"][ROUND]) == [0, 1, 2], "every party takes part in every round"
    check_views("millionaire", secrets, seen)


def test_matmul_views_are_uniform_secret_independent_and_free_of_inputs_and_result():
    """Secret A: x and w in [-8, 8] and [-2, 2]; secret B: x three times larger. The result
    is revealed to party 1 only: nobody else holds it or received it."""
    rng = np.random.default_rng(4)
    seen, secrets = {}, {}
    with RecordingSimulator(3, timeout=TIMEOUT) as sim:
        for name, scale in (("A", 1), ("B", 3)):
            x = rng.uniform(-8, 8, (16, 6)) * scale
            w = rng.uniform(-2, 2, (6, 8))
            out, seen[name] = views(sim, matmul, sim.put(0, x), sim.put(2, w))
            assert out.parties == {1}
            at_0, result, at_2 = sim.fetch(out)
            assert at_0 is None and at_2 is None
            for party in (0, 2):
                with pytest.raises(ValueError, match="does not hold"):
                    sim.fetch(out, party=party)
            want = (encode(x) / 2.0**F) @ (encode(w) / 2.0**F)
            np.testing.assert_allclose(result, want, atol=2.0**-F)
            secrets[name] = {0: _words(encode(x)), 2: _words(encode(w))}
            # the opened result reached party 1 alone, as one share; no round carried it
            reveal = seen[name][REVEAL]
            assert sorted(reveal) == [1] and len(reveal[1]) == EVALUATIONS
            assert all(m.value.shape == (16, 8) for m in reveal[1])
            plaintext = _words(encode(result))
            for kind, by_party in seen[name].items():
                for party, messages in by_party.items():
                    data = payload(messages)
                    assert not any(w in data for w in plaintext), f"{kind} to {party}: result"
    # the fused product and precise truncation send to roles 0 and 1; role 2 deals
    assert sorted(seen["A"][ROUND]) == [0, 1]
    check_views("matmul", secrets, seen)


@pytest.mark.slow
def test_sort_secret_index_and_secret_branch_views_are_uniform_and_secret_independent():
    """Secret A: x ascending and positive, indices 0..15 twice (no swap, the first branch);
    secret B: x descending and negative, indices 15..0 twice (swaps, the other branch)."""
    seen, secrets = {}, {}
    cases = {
        "A": (np.linspace(1.0, 16.0, 16), np.tile(np.arange(16, dtype=np.int32), 2)),
        "B": (np.linspace(-1.0, -16.0, 16), np.tile(np.arange(15, -1, -1, dtype=np.int32), 2)),
    }
    with RecordingSimulator(3, timeout=TIMEOUT) as sim:
        for name, (x, i) in cases.items():
            out, seen[name] = views(sim, selections, sim.put(0, x), sim.put(1, i))
            ordered, read, branch = sim.fetch(out, party=0)
            np.testing.assert_allclose(ordered, np.sort(x), atol=2.0**-F)
            np.testing.assert_allclose(read, x[i], atol=2.0**-F)
            np.testing.assert_allclose(branch, x * 2.0 if x[0] > 0 else -x, atol=2.0**-F)
            secrets[name] = {0: _words(encode(x)), 1: _words(i)}
    check_views("sort, secret index, secret branch", secrets, seen)


def product_views(truncation: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Secrets and views of x * y revealed to party 0. Secret A: products around 1; secret B:
    products up to 1e6 with precise truncation (where a broken one would show its wrap bits),
    up to 900 with probabilistic truncation (whose failure rate grows with the product: about
    3e-4 for these 96 products, 0.4 at 1e6)."""
    rng = np.random.default_rng(seed)
    seen, secrets = {}, {}
    large = 1e3 if truncation == "precise" else 30.0
    with RecordingSimulator(3, timeout=TIMEOUT) as sim:
        for name, scale in (("A", 1.0), ("B", large)):
            x = rng.uniform(-1, 1, 96) * scale
            y = rng.uniform(-1, 1, 96) * scale
            out, seen[name] = views(
                sim, product, sim.put(0, x), sim.put(2, y), seal=sealing(truncation)
            )
            result = sim.fetch(out)[0]
            want = (encode(x) / 2.0**F) * (encode(y) / 2.0**F)
            np.testing.assert_allclose(result, want, atol=2.0**-F)
            secrets[name] = {0: _words(encode(x)), 2: _words(encode(y))}
    return secrets, seen


@pytest.mark.parametrize("truncation", ["precise", "probabilistic"])
def test_fixed_point_product_views_are_uniform_under_either_truncation(truncation: str):
    secrets, seen = product_views(truncation, seed=5)
    check_views(f"product ({truncation} truncation)", secrets, seen)


def test_a_truncation_with_a_broken_mask_fails_the_views(monkeypatch: pytest.MonkeyPatch):
    """Mutation check: role 0's wrap-bit mask drawn as zeros (its bit then travels in clear
    to role 1) must fail the views the test above passes."""
    from mpplug.mpc.aby3 import ABY3

    drawn = ABY3._bit_product_masks

    def zero_mask_a(self: Any, ctx: Any, shape: Any, dtype: Any) -> Any:
        mask_a, *rest = drawn(self, ctx, shape, dtype)
        return [mask_a * np.uint64(0), *rest]

    monkeypatch.setattr(ABY3, "_bit_product_masks", zero_mask_a)
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")  # a traced program cached unbroken must not hide it
    monkeypatch.setattr(spliced, "_steps", LRUCache())  # nor a product's step traced unbroken
    secrets, seen = product_views("precise", seed=6)
    with pytest.raises(AssertionError, match="not uniform"):
        check_views("product with a broken mask", secrets, seen)


def test_a_chi_square_test_this_strong_sees_a_biased_view():
    """The statistics above are not vacuous: a view with one fixed bit in 64 fails them."""
    rng = np.random.default_rng(0)
    n = 6000  # about the u64 words of one view above
    words = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)  # top bit 0
    assert uniform_bytes_p(words.tobytes()) < P_MIN
    assert uniform_bits_p(words) < P_MIN
    other = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    assert uniform_bytes_p(other.tobytes()) > P_MIN and uniform_bits_p(other) > P_MIN
    assert same_distribution_p(words.tobytes(), other.tobytes()) < P_MIN


def test_freshness_fails_a_message_that_does_not_change_and_passes_chance_repeats():
    """A two-byte uniform message equal in two evaluations in a row (as one in 65,536 pairs
    is) passes; one bool, or two bytes, the same in every evaluation fails."""
    rng = np.random.default_rng(1)

    def evaluations(constant: np.ndarray | None) -> list[Received]:
        messages = []
        for run in range(EVALUATIONS):
            value = rng.integers(0, 256, 2, dtype=np.uint8)
            if run == 1:
                value = messages[-1].value.copy()  # a chance repeat
            messages.append(Received(f"run{run}", 7, 1, 0, value))
            if constant is not None:
                messages.append(Received(f"run{run}", 9, 1, 0, constant))
        return messages

    assert check_fresh("chance", evaluations(None)) == []
    for constant in (np.array([True]), np.array([3, 200], np.uint8)):
        failures = check_fresh("constant", evaluations(constant))
        assert len(failures) == 1 and "message of op 9 repeats" in failures[0], failures


def test_two_evaluations_share_afresh_and_the_shares_add_up():
    @mp.function
    def sealed_product(x: Any, y: Any) -> Any:
        a, b = mp.mpc.seal((x, y))
        return a, mp.mpc.run(lambda u, v: u * v, a, b)

    x = np.array([1.5, -2.25, 0.0, 100.0, -0.125, 3.0])
    y = np.array([2.0, 4.0, -7.5, 0.5, 8.0, -3.0])  # dyadic: every product is exact
    with RecordingSimulator(3, timeout=TIMEOUT) as sim:
        a, b = sim.put(0, x), sim.put(1, y)
        first = sim.evaluate(sealed_product, a, b)
        second = sim.evaluate(sealed_product, a, b)
        assert isinstance(first[0], mp.mpc.Sealed) and first[0].shares.parties == {0, 1, 2}
        fetched = [[sim.fetch(s.shares) for s in run] for run in (first, second)]
    for run in fetched:
        for shares, want in zip(run, (x, x * y), strict=True):
            assert all(s.dtype == np.uint64 and s.shape == (2, 6) for s in shares)
            for i in range(3):  # replicated: party i holds (x_i, x_i+1)
                np.testing.assert_array_equal(shares[i][1], shares[(i + 1) % 3][0])
            total = shares[0][0] + shares[1][0] + shares[2][0]  # wraps mod 2^64
            np.testing.assert_array_equal(total.view(np.int64), encode(want))
            for s in shares:
                assert not np.isin(s.view(np.int64), encode(want)).any()
    for one, two in zip(fetched[0], fetched[1], strict=True):
        for i in range(3):
            assert not (one[i] == two[i]).any(), f"party {i} got a share it had before"
