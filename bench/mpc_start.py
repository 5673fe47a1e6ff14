"""How fast mp.mpc programs start: the first evaluate of each `bench.mpc` workload in a fresh
process with an empty compile cache (cold) and again with the cache it left (warm), beside
SPU's first call; and the Driver with three local party processes beside the Simulator.

    python -m bench.mpc_start [--spu /tmp/spu.json ...] [--only SUBSTRING] [--driver] [--phases]
                              [--pairs N] [--json F]

first = `compile` (trace) + the first evaluate and fetch, timed inside the fresh process after
its inputs are put and `mpplug.mpc` is imported (SPU's first_s also starts from inputs at hand,
after `import spu`), with compiles going on in the background as by default (a long first
run starts them once it has run a second); the cached wall after it waits for them. Targets
(with --spu):
cold <= 2x SPU's first call, warm <= 1x; with --driver: the Driver's first evaluate <= 2x
the Simulator's and its cached wall <= 2x the Simulator's. Exit code 1 when one is missed.
With --pairs N each workload runs N cold and warm pairs, each pair with a cache of its own,
and the table shows each side's median run (its first evaluate the median, its trace and
cached wall with it): on a noisy machine one pair can read 30-60% off (SPU's anchor times
its first call once a run: give --spu several runs' files and SPU's first call is their
median).

With --phases the fresh processes trace and first evaluate inside `cluster.profile()` (a
little slower) and a second table says where each one's time went: the trace's phases (the
user's program, the share program, the rounds: scheduled, written, parsed, planned,
serialized, exported) and the first evaluate's (each party's preparation, kernel runs and
receive waits, averaged over the parties).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import mpplug as mp
from bench.mpc import RECV_TIMEOUT_S, error, load_spu, program, workloads
from bench.timing import machine_state, numpy_huge_page_advice, samples
from mpplug.kernels.prepare import ENV_TIER_UP

COLD_TARGET = 2.0
WARM_TARGET = 1.0
DRIVER_TARGET = 2.0
CHILD_TIMEOUT_S = 1800


ROUND_PHASES = ("scheduled", "parsed", "planned", "serialized", "exported")


def first_evaluate(cluster: Any, name: str, phases: bool = False) -> dict[str, Any]:
    """Trace and first evaluate of workload `name` on `cluster`, then its cached wall; with
    `phases`, the first two inside a profile, and where their time went."""
    (w,) = [w for w in workloads(False) if w.name == name]
    handles = [cluster.put(i % 3, a) for i, a in enumerate(w.args)]
    prog = program(w.fn, len(w.args), "precise")
    waits = os.environ.get(ENV_TIER_UP)
    os.environ[ENV_TIER_UP] = "background"  # the first evaluate a user meets (the default)
    try:
        with cluster.profile() if phases else contextlib.nullcontext() as timeline:
            start = time.perf_counter()
            cluster.compile(prog, *handles)
            trace = time.perf_counter() - start
            got = cluster.fetch(cluster.evaluate(prog, *handles), party=0)
            first = time.perf_counter() - start
    finally:
        os.environ[ENV_TIER_UP] = waits if waits is not None else "wait"
    wall = statistics.median(
        samples(lambda: cluster.fetch(cluster.evaluate(prog, *handles), party=0), 3)
    )
    out: dict[str, Any] = {"trace": trace, "first": first, "wall": wall}
    out["error"] = error(w.metric, got, w.ref)
    if timeline is not None:
        out["phases"] = phase_seconds(timeline.spans, cluster.world_size)
    return out


def phase_seconds(spans: list[Any], parties: int) -> dict[str, float]:
    """Seconds of each phase of a profiled trace and first evaluate: the caller's trace
    spans by name, each as its own time ("self ...": less the spans inside it, so a loop
    body's rounds, written inside the share program, count as rounds) and in all; and each
    party's preparation, kernel runs and receive waits, averaged over the parties."""
    found: dict[str, float] = {}

    def add(key: str, seconds: float) -> None:
        found[key] = found.get(key, 0.0) + seconds

    enclosing: list[Any] = []
    for span in sorted(
        (s for s in spans if s.category == "trace"), key=lambda s: (s.start_ns, -s.duration_ns)
    ):
        while enclosing and span.start_ns >= enclosing[-1].start_ns + enclosing[-1].duration_ns:
            enclosing.pop()
        if enclosing:
            add(f"self {enclosing[-1].name}", -span.duration_ns / 1e9)
        add(f"self {span.name}", span.duration_ns / 1e9)
        add(span.name, span.duration_ns / 1e9)
        enclosing.append(span)
    names = {"compile": "party prepare", "run": "party runs", "recv": "party waits"}
    for span in spans:
        if span.party >= 0 and span.category in names:
            add(names[span.category], span.duration_ns / 1e9 / parties)
    return found


def phase_rows(raw: dict[str, dict[str, Any]]) -> list[str]:
    """Where each workload's cold and warm first evaluates went (see `phase_seconds`)."""
    head = ["workload", "run", "trace s", "user s", "share program s", "rounds s"]
    head += [f"{p} s" for p in ROUND_PHASES] + ["written s", "evaluate s", "prepare s"]
    head += ["kernel runs s", "receive waits s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, runs in raw.items():
        for kind in ("cold", "warm"):
            p = runs[kind]["phases"]
            steps = [
                p.get("mpc rounds scheduled" if x == "scheduled" else f"mpc round {x}", 0.0)
                for x in ROUND_PHASES
            ]
            user = p.get("self trace", 0.0) + p.get("mpc recording loaded", 0.0)
            cells = [name, kind, p.get("trace", 0.0), user, p.get("self mpc share program", 0.0)]
            cells += [p.get("mpc rounds", 0.0), *steps, p.get("self mpc rounds", 0.0)]
            cells += [runs[kind]["first"] - runs[kind]["trace"], p.get("party prepare", 0.0)]
            cells += [p.get("party runs", 0.0), p.get("party waits", 0.0)]
            lines.append(
                "| " + " | ".join(c if isinstance(c, str) else f"{c:.2f}" for c in cells) + " |"
            )
    return lines


def child(name: str, phases: bool) -> None:
    with mp.Simulator(3, timeout=RECV_TIMEOUT_S) as sim:
        print(json.dumps(first_evaluate(sim, name, phases)), flush=True)


def in_fresh_process(name: str, cache: Path, phases: bool = False) -> dict[str, Any]:
    env = {**os.environ, "MPPLUG_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.mpc_start", "--child", name]
        + (["--phases"] if phases else []),
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the fresh process failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose first evaluate is the median of `runs` (the upper one of an even
    number), with its own trace, cached wall and phases."""
    return sorted(runs, key=lambda run: run["first"])[len(runs) // 2]


def start_rows(
    names: list[str], spu: dict[str, Any] | None, phases: bool = False, pairs: int = 1
) -> tuple[list[str], bool, dict]:
    head = ["workload", "cold first s (trace)", "warm first s (trace)", "cached wall s"]
    if spu is not None:
        head += ["SPU first s", "cold / SPU", "warm / SPU", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missed, raw = False, {}
    for name in names:
        colds, warms = [], []
        for _ in range(pairs):
            with tempfile.TemporaryDirectory(prefix="mpplug-cache-") as tmp:
                colds.append(in_fresh_process(name, Path(tmp), phases))
                warms.append(in_fresh_process(name, Path(tmp), phases))
        cold, warm = median_run(colds), median_run(warms)
        raw[name] = {"cold": cold, "warm": warm, "colds": colds, "warms": warms}
        cells = [
            name,
            f"{cold['first']:.2f} ({cold['trace']:.2f})",
            f"{warm['first']:.2f} ({warm['trace']:.2f})",
            f"{warm['wall']:.3f}",
        ]
        row = (spu or {}).get(name)
        if spu is not None and (row is None or row.get("first_s") is None):
            cells += ["n/a", "n/a", "n/a", "no SPU row"]
        elif spu is not None:
            first = row["first_s"]
            ok = cold["first"] <= COLD_TARGET * first and warm["first"] <= WARM_TARGET * first
            missed |= not ok
            cells += [
                f"{first:.3f}",
                f"{cold['first'] / first:.1f}x",
                f"{warm['first'] / first:.1f}x",
                "PASS" if ok else "FAIL",
            ]
        lines.append("| " + " | ".join(cells) + " |")
        print(f"  {name}: cold {cold['first']:.2f} s, warm {warm['first']:.2f} s", flush=True)
    return lines, missed, raw


def driver_rows(names: list[str]) -> tuple[list[str], bool, dict]:
    """Each workload first on the Simulator, then on a Driver with three local party
    processes; each side with its own empty compile cache."""
    from bench.load import local_cluster
    from mpplug.remote.driver import Driver

    head = ["workload", "Simulator first s", "Driver first s", "ratio", "Simulator wall s"]
    head += ["Driver wall s", "ratio", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missed, raw = False, {}
    with tempfile.TemporaryDirectory(prefix="mpplug-bench-") as tmp:
        root = Path(tmp)
        sims = {}
        os.environ["MPPLUG_CACHE_DIR"] = str(root / "simulator-cache")
        with mp.Simulator(3, timeout=RECV_TIMEOUT_S) as sim:
            for name in names:
                sims[name] = first_evaluate(sim, name)
        os.environ["MPPLUG_CACHE_DIR"] = str(root / "parties-cache")  # the parties inherit it
        with local_cluster(root):
            os.environ["MPPLUG_CACHE_DIR"] = str(root / "driver-cache")
            with Driver(root / "cluster.yaml", timeout=RECV_TIMEOUT_S) as driver:
                for name in names:
                    d, s = first_evaluate(driver, name), sims[name]
                    raw[name] = {"simulator": s, "driver": d}
                    first_ratio, wall_ratio = d["first"] / s["first"], d["wall"] / s["wall"]
                    ok = first_ratio <= DRIVER_TARGET and wall_ratio <= DRIVER_TARGET
                    missed |= not ok
                    lines.append(
                        f"| {name} | {s['first']:.2f} | {d['first']:.2f} | {first_ratio:.2f} | "
                        f"{s['wall']:.3f} | {d['wall']:.3f} | {wall_ratio:.2f} | "
                        f"{'PASS' if ok else 'FAIL'} |"
                    )
                    print(f"  {name}: driver first {d['first']:.2f} s", flush=True)
    return lines, missed, raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--spu",
        nargs="+",
        help="the SPU anchor's --json output (its first_s; several runs: median)",
    )
    ap.add_argument("--only", help="substring filter on workload names")
    ap.add_argument("--driver", action="store_true", help="also the Driver next to the Simulator")
    ap.add_argument("--phases", action="store_true", help="also where each first run's time went")
    ap.add_argument(
        "--pairs", type=int, default=1, help="cold and warm pairs a workload (median shown)"
    )
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.phases)
        return 0
    spu = load_spu(args.spu, need_wall=False) if args.spu else None
    names = [w.name for w in workloads(False) if not args.only or args.only in w.name]
    print(
        f"mpplug {mp.__version__} mp.mpc start-up: jax {jax.__version__}, numpy {np.__version__},"
        f" {os.cpu_count()} cores, {machine_state()}, NumPy huge pages {numpy_huge_page_advice()}"
        " (the Simulator's)",
        flush=True,
    )
    if args.pairs < 1:
        ap.error(f"--pairs must be at least 1, got {args.pairs}")
    lines, missed, raw = start_rows(names, spu, args.phases, args.pairs)
    print("\n" + "\n".join(lines))
    if args.phases:
        print("\n" + "\n".join(phase_rows(raw)))
    if args.driver:
        driver, driver_missed, raw_driver = driver_rows(names)
        missed |= driver_missed
        raw = {"start": raw, "driver": raw_driver}
        print("\n" + "\n".join(driver))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
