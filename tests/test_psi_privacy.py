"""What each party receives during ECDH private set intersection (`mp.psi`), on the Simulator:
the documented messages and sizes, fresh uniform points, independent of keys outside the set."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

import mpplug as mp
from mpplug.core.graph import OpKind, shuffle_sources
from mpplug.frontend.tracer import Program
from mpplug.tables import ecdh
from mpplug.tables import psi as protocol

from .mpc_views import Received, RecordingSimulator

# How the views are judged, for two parties (hub alice, peer bob) and three (hub alice, peers
# bob and carol), every input evaluated RUNS times (fresh scalars and shuffles each run):
# - every value received is recorded (tests/mpc_views.py's RecordingSimulator) and named by
#   the kernel that made it: `psi.blind` (points U = a*H(k), u8[n, 32]), `psi.reblind`
#   (twice-blinded points W, u8[n, 12]) or `psi.match` (the positions table); nothing else
#   crosses (no scalar), and the byte counts are those of mpplug/tables/psi.py's docstring;
# - points and twice-blinded points are uniform bytes: chi-square tests over the byte values
#   (pooled, and per byte position) and over the bit positions, each with p > P_MIN; no point
#   received in one run is received again in another (unlinkable), none is a hashed key H(k);
# - with the peer's keys outside the intersection changed (same sizes), the hub's view passes
#   the same tests and a two-sample chi-square does not tell the two apart; likewise the
#   peer's view (points and positions) with the hub's keys outside the intersection changed;
#   both parties' outputs are the intersection, in one common order, in every run.
# About 50 statistical tests on fresh randomness run at P_MIN = 1e-6: a correct protocol
# fails a run with probability < 1e-4 (the scalars come from the OS, so runs differ). The
# detectors are shown not to be vacuous on synthetic points (hashed keys, a fixed byte, a
# stuck bit, a biased byte) and on a mutated protocol whose scalars are fixed.
P_MIN = 1e-6
RUNS = 8
N_HUB, N_PEER, N_COMMON = 1000, 1200, 400
POINTS, TWICE, POSITIONS = protocol.BLIND, protocol.REBLIND, protocol.MATCH
TOP_BIT = 0x80
"""X25519 outputs are u-coordinates reduced mod p = 2^255 - 19 (RFC 7748), stored little-
endian: the top bit of byte 31 of every blinded point is 0, a known public structure. The tests
require it, then test byte 31 as uniform over 0..127 and leave bit 255 out of the bit test.
(The 19 values p..2^255-1 cannot occur either: a bias far below what these tests resolve.)"""


# --- what a party receives ----------------------------------------------------------------


@dataclass
class Views:
    """What each party received in each run of one input, by kind, and the outputs."""

    received: dict[int, dict[str, list[np.ndarray]]] = field(default_factory=dict)
    outputs: list[list[list[Any]]] = field(default_factory=list)  # run -> party -> ids

    def of(self, party: int, kind: str) -> list[np.ndarray]:
        """One array per run (a party receives each kind once per run and sender)."""
        return self.received.get(party, {}).get(kind, [])


def sent_by(program: Program, message: Received) -> str:
    """The kernel (`fn_type`) whose output party `message.src` sent in this SHUFFLE."""
    graph = program.graph
    op = graph.ops[message.op]
    while op.kind is OpKind.SHUFFLE:
        op = graph.ops[shuffle_sources(graph, op)[message.src].op]
    assert op.kind is OpKind.CALL, f"op {op.id} is {op.kind}"
    return graph.functions[op.function].fn_type


@mp.function
def psi_of(*tables: Any) -> Any:
    return mp.psi(*tables, key="id")


def psi_views(sim: RecordingSimulator, keys: Sequence[Sequence[int]]) -> Views:
    """Party i puts a table of `keys[i]` (with a payload column); mp.psi runs RUNS times."""
    tables = [
        sim.put(i, pa.table({"id": pa.array(k, pa.int64()), "x": np.arange(len(k))}))
        for i, k in enumerate(keys)
    ]
    program = sim.compile(psi_of, *tables)
    views = Views()
    for _ in range(RUNS):
        out, received = sim.evaluate_recorded(psi_of, *tables)
        for message in received:
            kind = sent_by(program, message)
            views.received.setdefault(message.dst, {}).setdefault(kind, []).append(message.value)
        fetched = [sim.fetch(v, party=i) for i, v in enumerate(out)]
        views.outputs.append([t.column("id").to_pylist() for t in fetched])
    return views


def key_sets(seed: int, sizes: dict[str, int]) -> dict[str, list[int]]:
    """Disjoint sets of distinct int64 keys, one per name, drawn with a fixed seed."""
    rng = np.random.default_rng(seed)
    drawn = rng.choice(2**62, size=sum(sizes.values()), replace=False).tolist()
    out, start = {}, 0
    for name, size in sizes.items():
        out[name] = drawn[start : start + size]
        start += size
    return out


def table_keys(*parts: list[int], seed: int) -> list[int]:
    """The union of `parts`, shuffled so that no key's row reveals which part it came from."""
    keys = list(itertools.chain(*parts))
    np.random.default_rng(seed).shuffle(keys)
    return keys


def hashed(keys: Sequence[int]) -> set[bytes]:
    """H(k) of integer keys as psi.blind hashes them, and their first 12 bytes."""
    encoded = [protocol.KEY_KINDS["i64"] + str(k).encode() for k in keys]
    points = ecdh.hash_to_points(encoded, protocol.DOMAIN)
    return {p.tobytes() for p in points} | {p[: protocol.COMPARE_BYTES].tobytes() for p in points}


# --- statistics ---------------------------------------------------------------------------


def byte_grid(rows: np.ndarray) -> np.ndarray:
    """counts[position, value] of the bytes of u8[m, w] `rows`."""
    w = rows.shape[1]
    flat = (np.arange(w) * 256 + rows.astype(np.int64)).reshape(-1)
    return np.bincount(flat, minlength=w * 256).reshape(w, 256)


def value_range(width: int) -> list[int]:
    """How many values each byte position takes: 256, but 128 for byte 31 (TOP_BIT)."""
    return [128 if i == ecdh.POINT_BYTES - 1 else 256 for i in range(width)]


def uniform_pooled_p(rows: np.ndarray) -> float:
    """p of 'the bytes at positions 0..30 are uniform over 0..255' (pooled histogram)."""
    grid = byte_grid(rows)[: ecdh.POINT_BYTES - 1]
    return float(stats.chisquare(grid.sum(axis=0)).pvalue)


def uniform_positions_p(rows: np.ndarray) -> float:
    """p of 'each byte position is uniform over its values', as one chi-square (the sum of
    the positions' statistics; byte 31 over 0..127)."""
    grid = byte_grid(rows)
    total, df = 0.0, 0
    for counts, k in zip(grid, value_range(rows.shape[1]), strict=True):
        total += float(stats.chisquare(counts[:k]).statistic)
        df += k - 1
    return float(stats.chi2.sf(total, df))


def uniform_bits_p(rows: np.ndarray) -> float:
    """p of 'each bit position is 1 half the time' (bit 255 of a point left out: TOP_BIT)."""
    bits = np.unpackbits(rows, axis=1, bitorder="little")[:, : min(8 * rows.shape[1], 255)]
    m = len(rows)
    z2 = (bits.sum(axis=0) - m / 2) ** 2 / (m / 4)
    return float(stats.chi2.sf(z2.sum(), df=bits.shape[1]))


def same_distribution_p(a: np.ndarray, b: np.ndarray) -> float:
    """p of 'a and b have one distribution of (byte position, value)' (two-sample chi-square
    over the cells either ever fills)."""
    table = np.stack([byte_grid(a).reshape(-1), byte_grid(b).reshape(-1)])
    return float(stats.chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue)


def check_points(
    name: str, runs: list[np.ndarray], hashes: AbstractSet[bytes] = frozenset()
) -> list[str]:
    """Failures of points (or twice-blinded points) received over several runs: TOP_BIT,
    uniformity, a point received in two runs, a point that is a hashed key."""
    rows = np.concatenate(runs)
    m, w = rows.shape
    assert m >= 20 * 256, f"{name}: too few rows ({m}) for the tests"
    failures = []
    if w == ecdh.POINT_BYTES and (set_bits := int((rows[:, -1] & TOP_BIT != 0).sum())):
        failures.append(f"{name}: top bit set in {set_bits} of {m} points (not X25519 outputs)")
    for test, p in (
        ("bytes", uniform_pooled_p(rows)),
        ("bytes by position", uniform_positions_p(rows)),
        ("bits", uniform_bits_p(rows)),
    ):
        if p <= P_MIN:
            failures.append(f"{name}: {test} not uniform (p = {p:.2g}, {m} rows)")
    seen: set[bytes] = set()
    for i, run in enumerate(runs):
        these = {row.tobytes() for row in run}
        if repeated := len(these & seen):
            failures.append(f"{name}: run {i} repeats {repeated} rows of earlier runs")
        seen |= these
    if leaked := len(seen & hashes):
        failures.append(f"{name}: {leaked} rows are hashed keys H(k)")
    return failures


def check_same(name: str, a: list[np.ndarray], b: list[np.ndarray]) -> list[str]:
    """Failures where a two-sample test tells views a and b apart."""
    if (p := same_distribution_p(np.concatenate(a), np.concatenate(b))) <= P_MIN:
        return [f"{name}: the two inputs' views differ (p = {p:.2g})"]
    return []


def position_histogram(runs: list[np.ndarray], rows: int, bins: int = 12) -> np.ndarray:
    return np.bincount(np.concatenate(runs).reshape(-1) * bins // rows, minlength=bins)


def check_positions(name: str, runs: list[np.ndarray], rows: int, size: int) -> list[str]:
    """Failures of the positions tables a peer received: each a table of `size` distinct rows
    of 0..rows-1, a fresh one each run (its shuffle is fresh), spread uniformly. Within a run
    the positions are drawn without replacement, so the chi-square is conservative."""
    failures = []
    for i, run in enumerate(runs):
        positions = run.reshape(-1)
        if run.shape != (size, 1) or run.dtype != np.int64:
            failures.append(f"{name}: run {i} has a {run.dtype}{list(run.shape)} table")
        elif len(set(positions.tolist())) != size or not (positions >= 0).all():
            failures.append(f"{name}: run {i} positions are not distinct rows")
        elif positions.max() >= rows:
            failures.append(f"{name}: run {i} positions past {rows} rows")
    if any(np.array_equal(one, two) for one, two in itertools.pairwise(runs)):
        failures.append(f"{name}: the positions repeat from one run to the next")
    if (p := float(stats.chisquare(position_histogram(runs, rows)).pvalue)) <= P_MIN:
        failures.append(f"{name}: positions not uniform over the rows (p = {p:.2g})")
    return failures


# --- two parties --------------------------------------------------------------------------

HUB, PEER = 0, 1


@pytest.fixture(scope="module")
def two_party() -> Iterator[tuple[dict[str, list[int]], dict[str, Views]]]:
    """Three inputs, RUNS runs each: 'base' (hub: common + hub_only; peer: common + peer_only),
    'peer changed' (the peer's keys outside the intersection replaced by as many others) and
    'hub changed' (likewise the hub's)."""
    keys = key_sets(
        11,
        {
            "common": N_COMMON,
            "hub_only": N_HUB - N_COMMON,
            "hub_other": N_HUB - N_COMMON,
            "peer_only": N_PEER - N_COMMON,
            "peer_other": N_PEER - N_COMMON,
        },
    )
    hub = table_keys(keys["common"], keys["hub_only"], seed=1)
    hub_changed = table_keys(keys["common"], keys["hub_other"], seed=2)
    peer = table_keys(keys["common"], keys["peer_only"], seed=3)
    peer_changed = table_keys(keys["common"], keys["peer_other"], seed=4)
    with RecordingSimulator(mp.ClusterSpec.local(["alice", "bob"])) as sim:
        views = {
            "base": psi_views(sim, [hub, peer]),
            "peer changed": psi_views(sim, [hub, peer_changed]),
            "hub changed": psi_views(sim, [hub_changed, peer]),
        }
    yield keys, views


def test_two_party_psi_is_correct_and_sends_the_documented_messages(
    two_party: tuple[dict[str, list[int]], dict[str, Views]],
) -> None:
    """Per run the peer receives U_hub (N_HUB * 32 bytes) and the positions (8 per common
    row); the hub receives W (N_HUB * 12 bytes) and U_peer (N_PEER * 32 bytes); no scalar
    crosses. Both outputs are the common keys, in one order, in every run."""
    keys, views = two_party
    common = sorted(keys["common"])
    for name, view in views.items():
        assert sorted(view.received) == [HUB, PEER], name
        assert sorted(view.received[PEER]) == [POINTS, POSITIONS], name
        assert sorted(view.received[HUB]) == [POINTS, TWICE], name
        for kind, shape, dtype in (
            ((PEER, POINTS), (N_HUB, 32), np.uint8),
            ((PEER, POSITIONS), (N_COMMON, 1), np.int64),
            ((HUB, TWICE), (N_HUB, 12), np.uint8),
            ((HUB, POINTS), (N_PEER, 32), np.uint8),
        ):
            runs = view.of(*kind)
            assert len(runs) == RUNS, (name, kind)
            assert all(r.shape == shape and r.dtype == dtype for r in runs), (name, kind)
        for run in range(RUNS):
            at_peer = sum(view.received[PEER][k][run].nbytes for k in (POINTS, POSITIONS))
            at_hub = sum(view.received[HUB][k][run].nbytes for k in (POINTS, TWICE))
            assert at_peer == N_HUB * 32 + N_COMMON * 8, name
            assert at_hub == N_PEER * 32 + N_HUB * 12, name
        orders = set()
        for at_hub, at_peer in view.outputs:
            assert at_hub == at_peer, f"{name}: the outputs' orders differ"
            assert sorted(at_hub) == common, f"{name}: the output is not the intersection"
            orders.add(tuple(at_hub))
        assert len(orders) == RUNS, f"{name}: the common order repeats from run to run"


def test_two_party_views_are_fresh_uniform_and_free_of_hashed_keys(
    two_party: tuple[dict[str, list[int]], dict[str, Views]],
) -> None:
    """Fixed inputs ('base'): what each party receives changes from run to run (fresh
    scalars) and passes the uniformity tests; the positions are fresh distinct rows."""
    keys, views = two_party
    view = views["base"]
    every_key = hashed(list(itertools.chain(*keys.values())))
    failures = check_points("U_hub at the peer", view.of(PEER, POINTS), every_key)
    failures += check_points("U_peer at the hub", view.of(HUB, POINTS), every_key)
    failures += check_points("W at the hub", view.of(HUB, TWICE), every_key)
    failures += check_positions("positions at the peer", view.of(PEER, POSITIONS), N_PEER, N_COMMON)
    assert not failures, "\n".join(failures)


def test_the_hubs_view_does_not_depend_on_the_peers_keys_outside_the_intersection(
    two_party: tuple[dict[str, list[int]], dict[str, Views]],
) -> None:
    """'base' against 'peer changed': the hub receives uniform, fresh points under either,
    and no two-sample test tells them apart; the outputs were the same rows in both (the
    test above)."""
    _, views = two_party
    base, changed = views["base"], views["peer changed"]
    failures = []
    for kind, name in ((POINTS, "U_peer at the hub"), (TWICE, "W at the hub")):
        failures += check_points(f"{name}, peer changed", changed.of(HUB, kind))
        failures += check_same(name, base.of(HUB, kind), changed.of(HUB, kind))
        # nor does any point link a run of one input to a run of the other (common keys too)
        failures += check_points(f"{name}, both", base.of(HUB, kind) + changed.of(HUB, kind))
    assert not failures, "\n".join(failures)


def test_the_peers_view_does_not_depend_on_the_hubs_keys_outside_the_intersection(
    two_party: tuple[dict[str, list[int]], dict[str, Views]],
) -> None:
    """'base' against 'hub changed': the peer's points and positions pass the tests under
    either and two-sample tests do not tell them apart; its output is the same rows."""
    keys, views = two_party
    base, changed = views["base"], views["hub changed"]
    failures = check_points("U_hub at the peer, hub changed", changed.of(PEER, POINTS))
    failures += check_same("U_hub at the peer", base.of(PEER, POINTS), changed.of(PEER, POINTS))
    failures += check_points(
        "U_hub at the peer, both", base.of(PEER, POINTS) + changed.of(PEER, POINTS)
    )
    failures += check_positions(
        "positions at the peer, hub changed", changed.of(PEER, POSITIONS), N_PEER, N_COMMON
    )
    histograms = np.stack(
        [position_histogram(v.of(PEER, POSITIONS), N_PEER) for v in (base, changed)]
    )
    if (p := float(stats.chi2_contingency(histograms).pvalue)) <= P_MIN:
        failures.append(f"positions at the peer: the two inputs' views differ (p = {p:.2g})")
    assert not failures, "\n".join(failures)
    outputs = {frozenset(run[PEER]) for v in (base, changed) for run in v.outputs}
    assert outputs == {frozenset(keys["common"])}


# --- three parties ------------------------------------------------------------------------


def test_three_party_views_have_the_documented_sizes_and_are_fresh_and_uniform() -> None:
    """Hub alice, peers bob and carol; some keys shared by two parties only. Each peer
    receives U_hub and the positions; the hub receives W_j and U_j from each peer j."""
    sizes = {"bob": 1100, "carol": 900}
    keys = key_sets(
        12,
        {
            "common": 300,
            "hub_bob": 150,
            "hub_carol": 150,
            "bob_carol": 150,
            "hub_only": N_HUB - 600,
            "bob_only": sizes["bob"] - 600,
            "carol_only": sizes["carol"] - 600,
        },
    )
    inputs = [
        table_keys(keys["common"], keys["hub_bob"], keys["hub_carol"], keys["hub_only"], seed=5),
        table_keys(keys["common"], keys["hub_bob"], keys["bob_carol"], keys["bob_only"], seed=6),
        table_keys(
            keys["common"], keys["hub_carol"], keys["bob_carol"], keys["carol_only"], seed=7
        ),
    ]
    with RecordingSimulator(mp.ClusterSpec.local(["alice", "bob", "carol"])) as sim:
        view = psi_views(sim, inputs)
    common = sorted(keys["common"])
    for outputs in view.outputs:
        assert outputs[0] == outputs[1] == outputs[2], "the outputs' orders differ"
        assert sorted(outputs[0]) == common
    every_key = hashed(list(itertools.chain(*keys.values())))
    failures = []
    for peer, n in ((1, sizes["bob"]), (2, sizes["carol"])):
        assert sorted(view.received[peer]) == [POINTS, POSITIONS]
        points, positions = view.of(peer, POINTS), view.of(peer, POSITIONS)
        assert len(points) == len(positions) == RUNS
        for u, at in zip(points, positions, strict=True):
            assert u.shape == (N_HUB, 32) and u.dtype == np.uint8
            assert u.nbytes + at.nbytes == N_HUB * 32 + len(common) * 8
        failures += check_points(f"U_hub at party {peer}", points, every_key)
        failures += check_positions(f"positions at party {peer}", positions, n, len(common))
    # the hub receives W_j and U_j from each peer, in that order of peers
    assert sorted(view.received[HUB]) == [POINTS, TWICE]
    points, twice = view.of(HUB, POINTS), view.of(HUB, TWICE)
    assert len(points) == len(twice) == 2 * RUNS
    for run in range(RUNS):
        u_runs = points[2 * run : 2 * run + 2]
        w_runs = twice[2 * run : 2 * run + 2]
        assert sorted(u.shape for u in u_runs) == sorted((n, 32) for n in sizes.values())
        assert all(w.shape == (N_HUB, 12) for w in w_runs)
        total = sum(x.nbytes for x in u_runs + w_runs)
        assert total == sum(sizes.values()) * 32 + 2 * N_HUB * 12
    failures += check_points("U_j at the hub", points, every_key)
    failures += check_points("W_j at the hub", twice, every_key)
    assert not failures, "\n".join(failures)


# --- the detectors are not vacuous ----------------------------------------------------------


def random_points(rng: np.random.Generator, m: int) -> np.ndarray:
    """Uniform points with TOP_BIT clear, as X25519 outputs look."""
    rows = rng.integers(0, 256, (m, 32), dtype=np.uint8)
    rows[:, -1] &= 0x7F
    return rows


def test_the_detectors_flag_structured_points() -> None:
    """Sizes as the views above (RUNS runs of N_PEER points). Uniform points pass; hashed,
    unblinded keys fail (the same each run, the top bit set, H(k) itself); a fixed byte, one
    stuck bit and a biased byte position fail; a two-sample test separates the last."""
    rng = np.random.default_rng(21)
    good = [random_points(rng, N_PEER) for _ in range(RUNS)]
    assert check_points("uniform", good) == []
    assert check_same("uniform", good, [random_points(rng, N_PEER) for _ in range(RUNS)]) == []

    keys = rng.choice(2**62, N_PEER, replace=False).tolist()
    hashes = hashed(keys)
    encoded = [protocol.KEY_KINDS["i64"] + str(k).encode() for k in keys]
    unblinded = ecdh.hash_to_points(encoded, protocol.DOMAIN)
    failures = "\n".join(check_points("unblinded", [unblinded] * RUNS, hashes))
    assert "top bit set" in failures and "repeats" in failures and "hashed keys" in failures

    fixed_byte = [random_points(rng, N_PEER) for _ in range(RUNS)]
    for rows in fixed_byte:
        rows[:, 5] = 0x5A
    assert uniform_pooled_p(np.concatenate(fixed_byte)) < P_MIN
    assert uniform_positions_p(np.concatenate(fixed_byte)) < P_MIN

    stuck_bit = [random_points(rng, N_PEER) for _ in range(RUNS)]
    for rows in stuck_bit:
        rows[:, 7] |= 0x01
    assert uniform_bits_p(np.concatenate(stuck_bit)) < P_MIN

    # byte 3 below 128 in 75% of points rather than 50%
    biased = [random_points(rng, N_PEER) for _ in range(RUNS)]
    for rows in biased:
        low = rng.random(N_PEER) < 0.5
        rows[low, 3] &= 0x7F
    assert uniform_positions_p(np.concatenate(biased)) < P_MIN
    assert "views differ" in "\n".join(check_same("biased", good, biased))

    # positions: a table that repeats, or positions bunched in the first rows
    fixed = np.sort(rng.choice(N_PEER, N_COMMON, replace=False)).reshape(-1, 1)
    assert "repeat" in "\n".join(check_positions("fixed", [fixed] * RUNS, N_PEER, N_COMMON))
    first = [rng.permutation(N_COMMON).reshape(-1, 1) for _ in range(RUNS)]
    assert "not uniform" in "\n".join(check_positions("first", first, N_PEER, N_COMMON))


def test_blinding_with_fixed_scalars_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: every party blinding with one fixed scalar still intersects right and
    sends uniform-looking points, but the same ones each run: the views link runs (and, for
    common keys, inputs), and the tests above must fail."""
    fixed = np.frombuffer(bytes(range(1, 33)), np.uint8)
    monkeypatch.setattr(protocol, "_scalar", lambda value: fixed)
    keys = key_sets(13, {"common": 200, "hub_only": 600, "peer_only": 700})
    hub = table_keys(keys["common"], keys["hub_only"], seed=8)
    peer = table_keys(keys["common"], keys["peer_only"], seed=9)
    with RecordingSimulator(mp.ClusterSpec.local(["alice", "bob"])) as sim:
        view = psi_views(sim, [hub, peer])
    assert all(sorted(out[0]) == sorted(keys["common"]) for out in view.outputs)
    # one run's points look uniform: no byte statistic sees a fixed scalar
    assert uniform_pooled_p(view.of(PEER, POINTS)[0]) > P_MIN
    for party, kind in ((PEER, POINTS), (HUB, POINTS), (HUB, TWICE)):
        failures = "\n".join(check_points("fixed scalars", view.of(party, kind)))
        assert "repeats" in failures, (party, kind)
