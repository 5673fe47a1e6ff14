"""`cluster.profile()`: a timeline of every op at every party, with transfers, kernel compile
and run, and the caller's calls, written as Chrome trace event JSON, on every cluster kind.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug.core.graph import OpKind
from mpplug.errors import PartyError
from mpplug.kernels.prepare import ENV_TIER_UP_AFTER
from mpplug.runtime.interpreter import Interpreter
from mpplug.runtime.profile import CALLER, CATEGORIES

from .test_conformance import fail_pfunction


@mp.function
def pipeline(x: mp.MPObject) -> mp.MPObject:
    """Party 0 doubles x and hands it to party 1, which adds one three times in a loop and
    sends the result to everyone."""
    doubled = mp.run_jax(lambda a: a * 2, x)
    at_one = mp.p2p(0, 1, doubled)
    looped = mp.fori_loop(0, 3, lambda i, v: mp.run_jax(lambda a: a + 1, v), at_one)
    return mp.bcast(1, looped, to=[0, 1, 2])


def expected_ops(program: mp.Program, rank: int) -> Counter[int]:
    """How many times party `rank` runs each op of `pipeline`'s program: the loop body's ops
    three times, the rest once."""
    counts: Counter[int] = Counter()

    def walk(plan, times: int) -> None:  # type: ignore[no-untyped-def]
        for step in plan.steps:
            counts[step.op.id] += times
            inner = 3 if step.op.kind is OpKind.WHILE else 1
            for region in step.regions:
                walk(region, times * inner)

    walk(Interpreter(program.graph, rank).plan, 1)
    return counts


def test_a_profile_covers_every_op_of_every_party_and_is_a_chrome_trace(make_cluster, tmp_path):
    cluster = make_cluster(3)
    x = cluster.put(0, np.float32(1.5))
    program = cluster.compile(pipeline, x)
    with cluster.profile() as timeline:
        out = cluster.evaluate(pipeline, x)
        assert [float(v) for v in cluster.fetch(out)] == [6.0, 6.0, 6.0]

    spans = timeline.spans
    for rank in range(3):
        ran = Counter(s.args["op"] for s in spans if s.party == rank and s.category == "op")
        assert ran == expected_ops(program, rank), f"party {rank}"
        loop_ops = [s for s in spans if s.party == rank and "scope" in s.args]
        assert all(len(s.args["scope"]) == 3 for s in loop_ops)

    calls = [s for s in spans if s.category == "op" and s.args["kind"] == "call"]
    runs = [s for s in spans if s.category == "run"]
    assert sorted((s.party, s.args["op"]) for s in runs) == sorted(
        (s.party, s.args["op"]) for s in calls
    )
    assert len([s for s in calls if s.name.startswith("jax.exec:")]) == 4  # 1 + 3 in the loop
    sends = [s for s in spans if s.category == "send"]
    receives = [s for s in spans if s.category == "recv"]
    assert sorted((s.party, s.args["to"]) for s in sends) == [(0, 1), (1, 0), (1, 2)]
    assert sorted((s.party, s.args["source"]) for s in receives) == [(0, 1), (1, 0), (2, 1)]
    assert all(s.args["bytes"] == 4 for s in sends + receives)
    caller = [s.name for s in spans if s.party == CALLER]
    assert "evaluate" in caller and "fetch" in caller
    for s in spans:
        assert s.category in CATEGORIES and s.duration_ns >= 0, s

    path = timeline.write(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {
        0: "caller",
        1: cluster.parties[0],
        2: cluster.parties[1],
        3: cluster.parties[2],
    }
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans)
    for e in complete:
        assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] in names


def test_a_kernels_preparation_and_its_compile_each_show_in_one_run(
    make_cluster, monkeypatch: pytest.MonkeyPatch
):
    """The first run shows the preparation; once the program has run for the tier-up time
    (0.05 s here and at the test parties), a run starts the compile in the background, and
    the first run after it ends shows it, once."""
    monkeypatch.setenv(ENV_TIER_UP_AFTER, "0.05")
    cluster = make_cluster(2)
    x = cluster.put(1, np.arange(5, dtype=np.float32))

    @mp.function
    def fresh(v: mp.MPObject) -> mp.MPObject:
        return mp.run_jax(lambda a: a * 0.5 + 7.25, v)  # a function no other test compiles

    compiles = []
    for run in range(200):
        with cluster.profile() as timeline:
            cluster.evaluate(fresh, x)
        spans = [s for s in timeline.spans if s.category == "compile"]
        if run == 0:
            assert [s.name for s in spans] == ["prepare functions"] and spans[0].party == 1
        else:
            compiles += [(run, s) for s in spans]
            assert [s.party for s in timeline.spans if s.category == "run"] == [1]
        if compiles and run > compiles[0][0]:
            break
        time.sleep(0.05)
    assert [s.name for _, s in compiles] == ["compile functions"], compiles
    ((run, span),) = compiles
    assert run >= 1 and span.party == 1 and span.duration_ns > 0


def test_nothing_is_recorded_outside_a_profile_block_and_failures_keep_their_spans(make_cluster):
    cluster = make_cluster(2)
    x = cluster.put(0, np.float32(1.0))
    with cluster.profile() as timeline:
        cluster.evaluate(pipeline_two, x)
    recorded = len(timeline.spans)
    cluster.evaluate(pipeline_two, x)
    assert len(timeline.spans) == recorded

    with cluster.profile() as failed, pytest.raises(PartyError):
        cluster.evaluate(fails_at_one, x)
    assert [s.party for s in failed.spans if s.category == "send"] == [0]


@mp.function
def pipeline_two(x: mp.MPObject) -> mp.MPObject:
    return mp.p2p(0, 1, mp.run_jax(lambda a: a + 1, x))


@mp.function
def fails_at_one(x: mp.MPObject) -> mp.MPObject:
    at_one = mp.p2p(0, 1, x)
    return mp.run_pfunc(fail_pfunction("failed after the hop"), at_one)[0]


def test_a_profiled_trace_records_its_phases_and_a_cached_or_unprofiled_one_records_none(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))  # no recording traced before

    @mp.function
    def secure(x: mp.MPObject, y: mp.MPObject) -> mp.MPObject:
        a, b = mp.mpc.seal(x), mp.mpc.seal(y)
        return mp.mpc.reveal(mp.mpc.run(lambda u, v: jnp.maximum(u * v, 0.25 * u), a, b))

    with mp.Simulator(3) as sim:
        x = sim.put(0, np.linspace(-1, 1, 6, dtype=np.float32))
        y = sim.put(1, np.full(6, 0.5, np.float32))
        with sim.profile() as timeline:
            program = sim.compile(secure, x, y)
            sim.compile(secure, x, y)  # cached: traced once
        traced = [s for s in timeline.spans if s.category == "trace"]
        assert all(s.party == CALLER and s.category in CATEGORIES for s in traced)
        names = Counter(s.name for s in traced)
        written = [f for f in program.graph.functions if f.fn_type == "jax.exec"]
        assert names["trace"] == 1 and names["mpc share program"] == 1
        assert names["mpc rounds"] == 1 and names["mpc rounds scheduled"] == 1
        assert names["mpc recording loaded"] == 1
        # each round this process had not written before: parsed, planned (a Simulator runs
        # its first run interpreted), serialized and exported once
        steps = [names[f"mpc round {step}"] for step in ("parsed", "planned", "serialized")]
        assert steps == [names["mpc round exported"]] * 3
        (whole,) = [s for s in traced if s.name == "trace"]
        (rounds,) = [s for s in traced if s.name == "mpc rounds"]
        assert whole.args == {"function": "secure"}
        assert names["mpc round exported"] > 0 and 0 < rounds.args["functions"] < len(written)
        for s in traced:  # each phase inside the trace that holds it
            assert whole.start_ns <= s.start_ns
            assert s.start_ns + s.duration_ns <= whole.start_ns + whole.duration_ns

        sim.compile(lambda v: mp.mpc.reveal(mp.mpc.run(jnp.abs, mp.mpc.seal(v))), x)
        assert len(timeline.spans) == len(traced)  # outside the block: nothing recorded
        got = sim.fetch(sim.evaluate(program, x, y), party=0)
    np.testing.assert_allclose(
        got, np.maximum(np.linspace(-1, 1, 6) * 0.5, 0.25 * np.linspace(-1, 1, 6)), atol=1e-4
    )


def test_a_phase_table_counts_each_span_once_where_a_loops_rounds_nest_in_its_share_program():
    from bench.mpc_start import phase_seconds
    from mpplug.runtime.profile import Span

    def span(name: str, start: float, end: float, party: int = CALLER, cat: str = "trace") -> Span:
        return Span(party, name, cat, int(start * 1e9), int((end - start) * 1e9))

    spans = [
        span("trace", 0, 10),
        span("mpc share program", 1, 6),
        span("mpc rounds", 2, 4),  # a loop body's, recorded inside the share program
        span("mpc rounds", 6, 9),
        span("mpc round parsed", 6.5, 7),
        *(span("prepare", 0, 0.3, party, "compile") for party in range(3)),
    ]
    got = phase_seconds(spans, 3)
    want = {"self trace": 2, "self mpc share program": 3, "mpc rounds": 5, "self mpc rounds": 4.5}
    assert {k: round(got[k], 6) for k in want} == want
    assert round(got["party prepare"], 6) == 0.3


def test_a_start_up_table_shows_each_sides_median_run_whole():
    from bench.mpc_start import median_run

    runs = [
        {"first": f, "trace": t, "wall": w}
        for f, t, w in ((0.9, 0.5, 1), (0.4, 0.1, 2), (0.6, 0.2, 3))
    ]
    assert median_run(runs) == {"first": 0.6, "trace": 0.2, "wall": 3}  # its own trace and wall
    assert median_run(runs[:2])["first"] == 0.9  # of two, the upper
    assert median_run(runs[1:2]) == runs[1]


def test_bench_mpc_shows_the_spread_of_a_runs_errors_beside_their_median():
    from bench.mpc import Comm, Result, fmt_errors

    def result(metric: str, errors: list[float]) -> Result:
        median = sorted(errors)[len(errors) // 2]
        return Result("w", "precise", 0.1, 0.2, 0.01, [0.01], Comm(), median, errors, metric)

    spread = result("max abs", [1.7e-5, 1.2e-5, 2.0e-5])
    assert fmt_errors(spread) == "max abs 1.70e-05 (1.20e-05-2.00e-05 over 3)"
    assert fmt_errors(result("max abs", [3e-6] * 4)) == "max abs 3.00e-06"
    assert fmt_errors(result("wrong", [0.0, 2.0, 0.0])) == "0 wrong (0-2 over 3)"


def test_several_runs_of_the_spu_anchor_are_compared_by_their_medians(tmp_path: Path) -> None:
    from bench.mpc import Comm, Result, load_spu, table

    def anchor_run(name: str, wall: float, error: str, first: float) -> Path:
        rows = [
            {
                "workload": "w",
                "protocol": "ABY3",
                "wall_median_s": wall,
                "first_s": first,
                "error": error,
                "send_bytes_mean": 100.0,
                "send_actions_max": 4,
            },
            {"workload": "w", "protocol": "SEMI2K", "wall_median_s": 9.0, "error": "max abs 1"},
        ]
        path = tmp_path / name
        path.write_text(json.dumps(rows))
        return path

    runs = [
        anchor_run("a.json", 0.5, "max abs 1.47e-05 (largest weight change 3.7e-03)", 0.6),
        anchor_run("b.json", 0.7, "max abs 1.64e-05", 0.8),
        anchor_run("c.json", 0.6, "max abs 2.23e-05", 0.9),
    ]
    (row,) = load_spu([str(p) for p in runs]).values()
    assert (row["protocol"], row["wall_median_s"], row["first_s"]) == ("ABY3", 0.6, 0.8)
    assert row["error_values"] == [1.47e-05, 1.64e-05, 2.23e-05]
    assert row["error_value"] == 1.64e-05
    assert load_spu([str(runs[0])])["w"]["error_value"] == 1.47e-05  # one run: its own

    ours = Result(
        "w",
        "precise",
        0.1,
        0.2,
        0.3,
        [0.3],
        Comm(bytes_sent={0: 90, 1: 90}),
        1.60e-05,
        [1.60e-05],
        "max abs",
    )
    text, missed = table([ours], load_spu([str(p) for p in runs]))
    assert "max abs 1.64e-05 (1.47e-05-2.23e-05 over 3)" in text and not missed
    text, missed = table([ours], load_spu([str(runs[0])]))  # above that one draw alone
    assert text.rstrip().endswith("FAIL (error) |") and missed
