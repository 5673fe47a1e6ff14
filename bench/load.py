"""Load on one cluster: concurrent Driver sessions on one set of real parties, and threads sharing
one Simulator, every result checked against the value its own session expects.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import mpplug as mp
from bench.timing import Target, percentile, verdict
from mpplug.config import ClusterSpec
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from simulator import Simulator

DRIVERS = 16
THREADS = 8
EVALUATIONS = 50
WARMUP = 1
"""Checked steps each session takes before the barrier (tracing, shipping, compiling)."""
TIMEOUT = 60.0
WIDTH = 1024
"""Elements of each session's state (int64: 8 KiB), so that a fetch moves bytes, not a scalar."""
SESSION_SPAN = 1_000_000
"""Session s starts at (s + 1) x SESSION_SPAN + [0, 1, ..., WIDTH - 1] with stride s + 1: no two
sessions share a value while WIDTH + steps x stride stays below SESSION_SPAN."""
ERRORS_SHOWN = 5


@mp.function
def step(state: mp.MPObject, stride: mp.MPObject) -> tuple[mp.MPObject, mp.MPObject]:
    """Party 1 hands its stride to party 0, which adds it to its state; the new state stays at
    party 0 for the next step and goes on to party 2 to be fetched. After k steps a session
    must read start + k x stride, both its own: a value of another session, another step or a
    stale state is a mismatch."""
    moved = mp.p2p(1, 0, stride)
    state = mp.run_jax(lambda s, d: s + d, state, moved)
    return state, mp.p2p(0, 2, state)


def session_inputs(session: int, width: int) -> tuple[np.ndarray[Any, Any], np.int64]:
    """The start state (party 0) and stride (party 1) of `session`."""
    start = (session + 1) * SESSION_SPAN + np.arange(width, dtype=np.int64)
    return start, np.int64(session + 1)


def expected(session: int, steps: int, width: int) -> np.ndarray[Any, Any]:
    """The value party 2 holds for `session` after `steps` steps."""
    start, stride = session_inputs(session, width)
    return start + steps * stride


@dataclass(frozen=True, eq=False)
class SessionRun:
    """What one session saw: (steps taken, value fetched) per fetch, warm-up included, in
    order; the latency of each timed evaluate+fetch; error messages; when it reached the
    barrier, and when its timed part began and ended (perf_counter seconds)."""

    session: int
    results: tuple[tuple[int, np.ndarray[Any, Any]], ...]
    latencies: tuple[float, ...]
    errors: tuple[str, ...]
    ready: float
    began: float
    ended: float

    @property
    def mismatches(self) -> int:
        return sum(
            not np.array_equal(value, expected(self.session, steps, np.size(value)))
            for steps, value in self.results
        )


@dataclass(frozen=True)
class LoadResult:
    """The sessions of one load run on one cluster, and the figures over all of them: they
    started together (a barrier after each took its WARMUP steps); throughput counts the timed
    evaluations over the wall time from the barrier to the last session's end, and a latency
    is one evaluate+fetch."""

    label: str
    runs: tuple[SessionRun, ...]

    @property
    def evaluations(self) -> int:
        return sum(len(run.latencies) for run in self.runs)

    @property
    def errors(self) -> int:
        return sum(len(run.errors) for run in self.runs)

    @property
    def mismatches(self) -> int:
        return sum(run.mismatches for run in self.runs)

    @property
    def seconds(self) -> float:
        return max(run.ended for run in self.runs) - min(run.began for run in self.runs)

    @property
    def throughput(self) -> float:
        """Timed evaluations per second over the timed wall time."""
        return self.evaluations / self.seconds if self.seconds > 0 else 0.0

    @property
    def p50(self) -> float:
        return _percentile(self.runs, 50)

    @property
    def p99(self) -> float:
        return _percentile(self.runs, 99)

    def first_errors(self, count: int = ERRORS_SHOWN) -> list[str]:
        return [f"session {r.session}: {e}" for r in self.runs for e in r.errors][:count]


def _percentile(runs: Sequence[SessionRun], q: float) -> float:
    samples = [t for run in runs for t in run.latencies]
    return percentile(samples, q) if samples else float("nan")


class _Session:
    """One session's loop on `cluster`; it records rather than raises its errors."""

    def __init__(self, session: int, cluster: mp.Cluster, width: int) -> None:
        self.session = session
        self.cluster = cluster
        self.results: list[tuple[int, np.ndarray[Any, Any]]] = []
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.steps = 0
        start, stride = session_inputs(session, width)
        self.state = cluster.put(0, start)
        self.stride = cluster.put(1, stride)

    def advance(self) -> None:
        """One evaluate+fetch, its result recorded; an error is recorded, not raised."""
        try:
            self.state, out = self.cluster.evaluate(step, self.state, self.stride)
            self.steps += 1
            self.results.append((self.steps, self.cluster.fetch(out, party=2)))
        except Exception as exc:  # counted: any error under load is a finding
            self.errors.append(_describe(exc))

    def run(self, evaluations: int, barrier: threading.Barrier) -> SessionRun:
        for _ in range(WARMUP):
            self.advance()
        ready = time.perf_counter()
        barrier.wait()
        began = time.perf_counter()
        for _ in range(evaluations):
            start = time.perf_counter()
            self.advance()
            self.latencies.append(time.perf_counter() - start)
        return SessionRun(
            self.session,
            tuple(self.results),
            tuple(self.latencies),
            tuple(self.errors),
            ready,
            began,
            time.perf_counter(),
        )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _concurrently(
    label: str, sessions: int, body: Callable[[int, threading.Barrier], SessionRun]
) -> LoadResult:
    """Run `body(session, barrier)` for every session in its own thread; a session whose
    setup failed is a run with that error and no evaluations. The barrier breaks after
    TIMEOUT x 2 seconds so that one stuck session cannot hold the others forever."""
    barrier = threading.Barrier(sessions, timeout=2 * TIMEOUT)
    runs: list[SessionRun | None] = [None] * sessions

    def thread(session: int) -> None:
        try:
            runs[session] = body(session, barrier)
        except Exception as exc:  # setup failed: the others must not wait for it
            barrier.abort()
            now = time.perf_counter()
            runs[session] = SessionRun(session, (), (), (_describe(exc),), now, now, now)

    threads = [
        threading.Thread(target=thread, args=(s,), name=f"load-{label}-{s}")
        for s in range(sessions)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return LoadResult(label, tuple(r for r in runs if r is not None))


def remote_load(
    config: str | Path,
    drivers: int = DRIVERS,
    evaluations: int = EVALUATIONS,
    width: int = WIDTH,
) -> LoadResult:
    """`drivers` Driver sessions on the parties of `config` at once (each opened in its own
    thread), each taking `evaluations` timed steps on a state of `width` elements."""

    def body(session: int, barrier: threading.Barrier) -> SessionRun:
        with Driver(config, timeout=TIMEOUT) as driver:
            return _Session(session, driver, width).run(evaluations, barrier)

    return _concurrently(f"{drivers} Drivers", drivers, body)


def simulator_load(
    threads: int = THREADS, evaluations: int = EVALUATIONS, width: int = WIDTH
) -> LoadResult:
    """`threads` threads sharing one 3-party Simulator, each its own session of `evaluations`
    timed steps on a state of `width` elements."""
    with Simulator(3, timeout=TIMEOUT) as sim:
        return _concurrently(
            f"{threads} threads on one Simulator",
            threads,
            lambda session, barrier: _Session(session, sim, width).run(evaluations, barrier),
        )


@contextmanager
def local_cluster(workdir: Path) -> Iterator[LocalParties]:
    """Three party processes on free loopback ports, serving; killed on exit."""
    config = workdir / "cluster.yaml"
    config.write_text(yaml.safe_dump(ClusterSpec.local(3).to_dict()))
    with LocalParties(config, log_dir=workdir / "logs") as parties:
        parties.start()
        parties.wait_ready(timeout=120.0)
        yield parties


def table(results: Sequence[LoadResult]) -> list[str]:
    """A markdown table, one row per load run."""
    lines = [
        "| cluster | evaluations | errors | mismatches | evaluations/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {r.evaluations} | {r.errors} | {r.mismatches} | "
            f"{r.throughput:.0f} | {r.p50 * 1e3:.2f} | {r.p99 * 1e3:.2f} |"
        )
    return lines


def target(result: LoadResult, sessions: int, evaluations: int) -> Target:
    """PASS when every session took every step with no error and read only its own values."""
    complete = result.evaluations == sessions * evaluations
    got = (
        f"{result.errors} errors, {result.mismatches} mismatches, {result.evaluations} evaluations"
    )
    return Target(
        f"{result.label} x {evaluations} evaluations: 0 errors, 0 mismatches",
        complete and result.errors == 0 and result.mismatches == 0,
        got,
    )


def main() -> int:
    with (
        tempfile.TemporaryDirectory(prefix="mpplug-load-") as tmp,
        local_cluster(Path(tmp)) as parties,
    ):
        remote = remote_load(parties.config)
        if remote.errors:
            print(f"party logs:\n{parties.logs()}", file=sys.stderr)
    simulated = simulator_load()
    print("mpplug load: concurrent sessions on one 3-party cluster, every result checked\n")
    print("\n".join(table([remote, simulated])))
    for result in (remote, simulated):
        for line in result.first_errors():
            print(f"  {result.label}: {line}")
    return verdict([target(remote, DRIVERS, EVALUATIONS), target(simulated, THREADS, EVALUATIONS)])


if __name__ == "__main__":
    sys.exit(main())
