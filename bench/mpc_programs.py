"""Memory of a long-lived cluster that evaluates many distinct small secure programs: each a
secure `x * c + 1` on 16 values with its own constant c (so each compiles its own round
functions), on the Simulator and on a party server (Driver, three local party processes).

    python -m bench.mpc_programs [--programs 500,5000] [--runs 2] [--driver]

Each program runs `--runs` times: its first run is interpreted, the second compiles its
functions (so both tiers' caches fill).

Prints, at each checkpoint, the memory-map count and RSS of the process that runs the parties
(this one for the Simulator, party P0's for the Driver). Target: the map count stays within the
bound the executable caches set (1,024 executables and MPPLUG_EXECUTABLES_MB, default 64 MiB:
about 20,000 maps, checked here as at most 30,000) instead of growing with the programs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import mpplug as mp

MAP_LIMIT = 30_000
"""Well under the kernel's default vm.max_map_count (65,530)."""


def usage(pid: int) -> tuple[int, float]:
    """(memory maps, RSS MiB) of process `pid`."""
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    return maps, rss


def program(c: float) -> mp.MPFunction:
    @mp.function
    def scaled(v: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(lambda a: a * c + 1.0, mp.mpc.seal(v)), to=0)

    return scaled


def run(cluster: Any, pid: int, checkpoints: list[int], runs: int, label: str) -> list[str]:
    x = cluster.put(0, np.arange(16, dtype=np.float64))
    rows, start = [], time.perf_counter()
    for i in range(max(checkpoints)):
        c = i + 0.5
        prog = program(c)
        for _ in range(runs):
            got = cluster.fetch(cluster.evaluate(prog, x), party=0)
            np.testing.assert_allclose(got, np.arange(16) * c + 1, atol=1e-3 * max(1.0, c))
        if i + 1 in checkpoints:
            maps, rss = usage(pid)
            per = (time.perf_counter() - start) / (i + 1)
            verdict = "PASS" if maps <= MAP_LIMIT else "FAIL"
            rows.append(f"| {label} | {i + 1:,} | {maps:,} | {rss:,.0f} | {per:.2f} | {verdict} |")
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="500,5000", help="checkpoints, comma-separated")
    ap.add_argument("--runs", type=int, default=2, help="runs of each program")
    ap.add_argument("--driver", action="store_true", help="also a party server (Driver)")
    args = ap.parse_args()
    checkpoints = sorted(int(n) for n in args.programs.split(","))
    print("| cluster | programs | memory maps | RSS MiB | s per program | target |")
    print("|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpplug-bench-") as tmp:
        os.environ["MPPLUG_CACHE_DIR"] = str(Path(tmp) / "cache")
        with mp.Simulator(3) as sim:
            rows += run(sim, os.getpid(), checkpoints, args.runs, "Simulator")
        if args.driver:
            from bench.load import local_cluster
            from mpplug.remote.driver import Driver

            with (
                local_cluster(Path(tmp)) as parties,
                Driver(Path(tmp) / "cluster.yaml", timeout=120.0) as driver,
            ):
                rows += run(
                    driver, parties.processes["P0"].pid, checkpoints, args.runs, "party server P0"
                )
    return 0 if all(row.endswith("PASS |") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
