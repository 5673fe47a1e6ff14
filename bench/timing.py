"""The timing helpers every benchmark shares: medians of calls taken in turns, percentiles, the
PASS/FAIL verdict lines with the exit code they imply, and what a header says of the process.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpplug.core.memory import numpy_huge_pages


def numpy_huge_page_advice() -> str:
    """Whether NumPy advises huge pages for this process's big arrays ("on", "off"): the
    Simulator's interpreted first runs, on a VM, fault them in slowly (docs/mpc.md)."""
    advice = numpy_huge_pages()
    return "unknown" if advice is None else "on" if advice else "off"


def machine_state() -> str:
    """The load average and how many mpplug party processes run already, for a header: a row
    timed right after another benchmark was killed read 3.7x slower (docs/mpc.md)."""
    load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown"
    parties = party_processes()
    running = "unknown" if parties is None else str(parties)
    return f"load avg {load} at start, {running} mpplug party processes running"


def party_processes(proc: Path = Path("/proc")) -> int | None:
    """How many `mpplug.remote.server` processes this host runs, and `mpplug.remote.forkserver`
    ones (a fork server and the parties it forked show its command line) (None: no /proc to
    read)."""
    if not proc.is_dir():
        return None
    count = 0
    for entry in proc.iterdir():
        try:
            command = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:  # gone meanwhile, or not ours to read
            continue
        count += b"mpplug.remote.server\0" in command or b"mpplug.remote.forkserver\0" in command
    return count


def median_seconds(call: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """The median wall time of `call()` over `repeat` calls, after `warmup` untimed ones."""
    return side_by_side({"call": call}, repeat, warmup, rounds=1)["call"]


def samples(call: Callable[[], object], repeat: int, warmup: int = 0) -> list[float]:
    """The wall time of each of `repeat` calls of `call()`, after `warmup` untimed ones."""
    for _ in range(warmup):
        _ready(call())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _ready(call())
        times.append(time.perf_counter() - start)
    return times


def side_by_side(
    calls: dict[str, Callable[[], object]], repeat: int, warmup: int = 2, rounds: int = 5
) -> dict[str, float]:
    """The median wall time of each call, taking turns call by call so that machine noise hits
    every contender alike. The calls are split into `rounds`, and the quietest round (the
    smallest sum of medians) is kept for all contenders, which filters out bursts of load from
    other processes while keeping the contenders paired. A call that returns something with
    `block_until_ready` is timed until its result is ready."""
    for _ in range(warmup):
        for call in calls.values():
            _ready(call())
    best: dict[str, float] = {}
    per_round = max(1, repeat // rounds)
    for _ in range(rounds):
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(per_round):
            for name, call in calls.items():
                start = time.perf_counter()
                _ready(call())
                samples[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(s) for name, s in samples.items()}
        if not best or sum(medians.values()) < sum(best.values()):
            best = medians
    return best


def _ready(result: object) -> None:
    block = getattr(result, "block_until_ready", None)
    if block is not None:
        block()


def percentile(samples: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `samples`, nearest-rank."""
    ordered = sorted(samples)
    rank = max(1, round(q / 100 * len(ordered) + 0.5 - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class Target:
    """One target of a benchmark: what was asked, whether it was met, what was measured."""

    label: str
    met: bool
    got: str

    def line(self) -> str:
        return f"{'PASS' if self.met else 'FAIL'}: {self.label} (got {self.got})"


def verdict(targets: Sequence[Target]) -> int:
    """Print one PASS/FAIL line per target; the exit code: 1 if any was missed, else 0."""
    print()
    for target in targets:
        print(target.line())
    return 0 if all(t.met for t in targets) else 1
