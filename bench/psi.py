"""mp.psi (ECDH over X25519) and mp.sql at two parties, next to SPU 0.9.5's PSI anchor and
DuckDB alone; `python -m bench.psi --spu /tmp/psi.json [--sizes 1e5,1e6] [--driver]`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import yaml

import mpplug as mp
from bench.timing import Target, side_by_side, verdict
from mpplug.config import ClusterSpec
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.runtime.profile import Timeline

PARTIES = ("alice", "bob")
"""alice is mp.psi's hub, as SPU's rank 0 (receiver); bob is SPU's rank 1 (sender)."""
WARMUP_N = 1_000
"""The cold run's n: each cluster's first evaluate, so that the measured ones exclude imports."""
TIMEOUT_S = 900.0
"""Per receive: at 1e6 a party waits for its peer's whole x25519 pass."""
PSI_TARGET = 1.5
"""mp.psi wall <= this x SPU's ECDH-25519 wall, at n = TARGET_N."""
TARGET_N = 1_000_000
SQL_TARGET = 1.5
"""mp.sql at a party <= this x DuckDB alone on the same query."""
SQL_ROWS = 1_000_000
SQL_COLUMNS = 8
SQL_REPEATS = 10
KERNELS = ("psi.blind", "psi.reblind", "psi.match", "psi.select", "shuffle")
"""Op spans by name; a shuffle's span is its receive: waiting for the peer, then decoding."""
ENDPOINTS = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(\"[^\"]*\",pid=(\d+)")
ACKED = re.compile(r"bytes_acked:(\d+)")


# ---------------------------------------------------------------- data (SPU's generator)


def spu_ids(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The anchor's make_data, line for line: each party's n distinct 18-digit IDs, rows
    shuffled, n/2 shared; returns (party 0's, party 1's, the shared ones)."""
    rng = np.random.default_rng(seed)
    half = n // 2
    need = 2 * n - half
    vals = np.unique(rng.integers(10**17, 10**18, size=need + need // 100 + 16, dtype=np.int64))
    vals = rng.permutation(vals)[:need]
    assert vals.size == need
    shared, only0, only1 = vals[:half], vals[half:n], vals[n:]
    rows = [rng.permutation(np.concatenate([shared, own])) for own in (only0, only1)]
    return rows[0], rows[1], shared


def sql_table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns = {"id": np.arange(rows, dtype=np.int64)}
    columns |= {f"x{i}": rng.normal(size=rows) for i in range(SQL_COLUMNS)}
    return pa.table(columns)


SQL_QUERY = (
    "SELECT id, "
    + ", ".join(
        f"(x{i} - avg(x{i}) OVER ()) / stddev_pop(x{i}) OVER () AS z{i}" for i in range(SQL_COLUMNS)
    )
    + " FROM t WHERE x0 > -1.0"
)
"""A filter, then every column standardized over the rows kept (about 84%)."""


@mp.function
def intersect(ta: mp.MPObject, tb: mp.MPObject) -> Any:
    return mp.psi(ta, tb, key="id")


@mp.function
def standardize(t: mp.MPObject) -> mp.MPObject:
    return mp.sql(PARTIES[0], SQL_QUERY, t=t)


def duckdb_alone(table: pa.Table) -> pa.Table:
    con = duckdb.connect()
    try:
        con.register("t", table)
        return con.sql(SQL_QUERY).to_arrow_table()
    finally:
        con.close()


# ---------------------------------------------------------------- meters


def cpu_seconds(pids: list[int]) -> float:
    """CPU time so far of this process (the Simulator's parties are its threads) and `pids`."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def tcp_snapshot() -> dict[tuple[str, str], tuple[int, int]]:
    """{(local, peer): (owning pid, bytes_acked)} of this host's established TCP sockets."""
    out = subprocess.run(
        ["ss", "-tinpHO", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    snap = {}
    for line in out.splitlines():
        m, acked = ENDPOINTS.search(line), ACKED.search(line)
        if m:
            local, peer = f"{m[1]}:{m[2]}", f"{m[3]}:{m[4]}"
            snap[(local, peer)] = (int(m[5]), int(acked[1]) if acked else 0)
    return snap


def wire_sent(
    before: dict[tuple[str, str], tuple[int, int]],
    after: dict[tuple[str, str], tuple[int, int]],
    pids: list[int],
) -> list[int]:
    """TCP payload each party process sent to another party between two snapshots (the
    driver's connections left out), as the anchor counts SPU's."""
    sent = [0] * len(pids)
    for (local, peer), (pid, acked) in after.items():
        peer_pid = after.get((peer, local), (None, 0))[0]
        if pid in pids and peer_pid in pids and peer_pid != pid:
            sent[pids.index(pid)] += acked - before.get((local, peer), (pid, 0))[1]
    return sent


# ---------------------------------------------------------------- PSI


@dataclass
class PsiRow:
    cluster: str
    n: int
    cold: bool
    """The cluster's first evaluate: kernel imports, thread pools, connections included."""
    trace_s: float
    wall_s: float
    cpu_s: float
    sent: list[int]
    """Payload bytes each party's sends carried (the profile's send spans)."""
    wire: list[int] | None
    """TCP payload between the party processes (Driver only)."""
    intersection: int
    expected: int
    same_order: bool
    correct: bool
    load: float
    kernels: dict[str, list[float]] = field(default_factory=dict)
    """Seconds each party spent in each kernel (and waiting in shuffle), by kernel."""


def kernel_seconds(timeline: Timeline, parties: int) -> dict[str, list[float]]:
    seconds = {k: [0.0] * parties for k in KERNELS}
    for span in timeline.spans:
        name = span.name.split(":")[0]
        if span.category == "op" and name in seconds:
            seconds[name][span.party] += span.duration_ns / 1e9
    return seconds


def sent_bytes(timeline: Timeline, parties: int) -> list[int]:
    sent = [0] * parties
    for span in timeline.spans:
        if span.category == "send":
            sent[span.party] += span.args["bytes"]
    return sent


def run_psi(cluster: Any, label: str, n: int, seed: int, pids: list[int], cold: bool) -> PsiRow:
    """Trace mp.psi for tables of n rows (the row count is in their type), then one evaluate,
    timed and profiled; the inputs are put beforehand."""
    ids_a, ids_b, shared = spu_ids(n, seed)
    ta = cluster.put(PARTIES[0], pa.table({"id": ids_a}))
    tb = cluster.put(PARTIES[1], pa.table({"id": ids_b}))
    start = time.perf_counter()
    cluster.compile(intersect, ta, tb)
    trace = time.perf_counter() - start
    load = os.getloadavg()[0]
    snap, cpu = tcp_snapshot() if pids else {}, cpu_seconds(pids)
    with cluster.profile() as timeline:
        start = time.perf_counter()
        ia, ib = cluster.evaluate(intersect, ta, tb)
        wall = time.perf_counter() - start
    cpu = cpu_seconds(pids) - cpu
    wire = wire_sent(snap, tcp_snapshot(), pids) if pids else None
    got_a = cluster.fetch(ia, PARTIES[0]).column("id")
    got_b = cluster.fetch(ib, PARTIES[1]).column("id")
    same = got_a.equals(got_b)
    right = len(got_a) == len(shared) and set(got_a.to_pylist()) == set(shared.tolist())
    return PsiRow(
        label,
        n,
        cold,
        trace,
        wall,
        cpu,
        sent_bytes(timeline, len(PARTIES)),
        wire,
        len(got_a),
        len(shared),
        same,
        same and right,
        load,
        kernel_seconds(timeline, len(PARTIES)),
    )


# ---------------------------------------------------------------- SQL


@dataclass
class SqlRow:
    cluster: str
    mp_sql_s: float
    duckdb_s: float
    rows_out: int
    correct: bool
    load: float


def run_sql(cluster: Any, label: str, table: pa.Table) -> SqlRow:
    """Median of mp.sql evaluates (the output stays at the party) and of DuckDB alone in
    this process, timed in turns."""
    handle = cluster.put(PARTIES[0], table)
    expected = duckdb_alone(table).sort_by("id")
    got = cluster.fetch(cluster.evaluate(standardize, handle), PARTIES[0]).sort_by("id")
    correct = got.num_rows == expected.num_rows and all(
        np.allclose(got.column(c).to_numpy(), expected.column(c).to_numpy())
        for c in expected.column_names
    )
    load = os.getloadavg()[0]
    times = side_by_side(
        {
            "mp.sql": lambda: cluster.evaluate(standardize, handle),
            "duckdb": lambda: duckdb_alone(table),
        },
        repeat=SQL_REPEATS,
    )
    return SqlRow(label, times["mp.sql"], times["duckdb"], expected.num_rows, correct, load)


# ---------------------------------------------------------------- clusters


@contextmanager
def simulator() -> Iterator[tuple[Any, list[int]]]:
    with mp.Simulator(ClusterSpec.local(list(PARTIES)), timeout=TIMEOUT_S) as sim:
        yield sim, []


@contextmanager
def driver() -> Iterator[tuple[Any, list[int]]]:
    """Two party processes on loopback (no TLS) and a Driver session on them."""
    with tempfile.TemporaryDirectory(prefix="mpplug-bench-psi-") as tmp:
        config = Path(tmp) / "cluster.yaml"
        config.write_text(yaml.safe_dump(ClusterSpec.local(list(PARTIES)).to_dict()))
        with LocalParties(config, log_dir=Path(tmp) / "logs", timeout=TIMEOUT_S) as parties:
            parties.start()
            parties.wait_ready(timeout=120.0)
            pids = [parties.processes[name].pid for name in PARTIES]
            with Driver(config, timeout=TIMEOUT_S) as drv:
                yield drv, pids


def measure(label: str, sizes: list[int], seed: int, sql: pa.Table) -> tuple[list[PsiRow], SqlRow]:
    rows = []
    with simulator() if label == "Simulator" else driver() as (cluster, pids):
        for n in [WARMUP_N, *sizes]:
            rows.append(run_psi(cluster, label, n, seed, pids, cold=not rows))
            print(f"  {json.dumps(asdict(rows[-1]))}", flush=True)
        sql_row = run_sql(cluster, label, sql)
        print(f"  {json.dumps(asdict(sql_row))}", flush=True)
    return rows, sql_row


# ---------------------------------------------------------------- SPU's figures


@dataclass
class SpuRow:
    wall_s: float
    sent: list[int]
    cpu_s: float


def load_spu(path: str) -> dict[tuple[str, int], SpuRow]:
    """The anchor's results by (protocol, n): median wall over its runs, and the bytes and
    CPU of the run with the median wall."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in json.loads(Path(path).read_text())["runs"]:
        if run.get("status") == "ok":
            runs.setdefault((run["protocol"], run["n"]), []).append(run)
    out = {}
    for key, ok in runs.items():
        mid = sorted(ok, key=lambda r: r["wall_max_s"])[(len(ok) - 1) // 2]
        out[key] = SpuRow(
            statistics.median(r["wall_max_s"] for r in ok),
            mid["bytes_sent_per_rank"],
            mid["cpu_s"],
        )
    return out


# ---------------------------------------------------------------- tables


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def per_id(sent: list[int] | None, n: int) -> str:
    return "n/a" if sent is None else " / ".join(f"{b / n:.1f}" for b in sent)


def psi_table(rows: list[PsiRow]) -> str:
    head = [
        "cluster",
        "n per party",
        "trace s",
        "wall s",
        "CPU s (cores)",
        "B/ID sent alice / bob (payload)",
        "B/ID alice / bob (TCP)",
        "intersection (expected)",
        "same order",
        "correct",
        "load 1-min",
    ]
    body = [
        [
            r.cluster,
            f"{r.n:,}" + " (cold)" * r.cold,
            f"{r.trace_s:.3f}",
            f"{r.wall_s:.2f}",
            f"{r.cpu_s:.1f} ({r.cpu_s / r.wall_s:.2f})",
            per_id(r.sent, r.n),
            per_id(r.wire, r.n),
            f"{r.intersection:,} ({r.expected:,})",
            "yes" if r.same_order else "NO",
            "yes" if r.correct else "NO",
            f"{r.load:.2f}",
        ]
        for r in rows
    ]
    return markdown(head, body)


def kernel_table(rows: list[PsiRow]) -> str:
    head = ["cluster", "n", *(f"{k} s alice / bob" for k in KERNELS)]
    body = [
        [r.cluster, f"{r.n:,}" + " (cold)" * r.cold]
        + [f"{r.kernels[k][0]:.2f} / {r.kernels[k][1]:.2f}" for k in KERNELS]
        for r in rows
    ]
    return markdown(head, body)


def spu_table(rows: list[PsiRow], spu: dict[tuple[str, int], SpuRow]) -> str:
    head = [
        "cluster",
        "n",
        "wall s",
        "ECDH-25519 s",
        "x ECDH",
        "RR22 s",
        "x RR22",
        "B/ID max party (TCP if measured)",
        "ECDH B/ID",
        "x ECDH bytes",
        "RR22 B/ID recv / send",
        "cores ours / ECDH",
    ]
    body = []
    for r in rows:
        if r.cold:
            continue
        ecdh, rr22 = spu.get(("ECDH-25519", r.n)), spu.get(("RR22", r.n))
        ours = max(r.wire or r.sent) / r.n
        cells = [r.cluster, f"{r.n:,}", f"{r.wall_s:.2f}"]
        if ecdh is None:
            cells += ["n/a"] * 2
        else:
            cells += [f"{ecdh.wall_s:.2f}", f"{r.wall_s / ecdh.wall_s:.2f}"]
        cells += (
            ["n/a"] * 2 if rr22 is None else [f"{rr22.wall_s:.2f}", f"{r.wall_s / rr22.wall_s:.2f}"]
        )
        cells.append(f"{ours:.1f}")
        if ecdh is None:
            cells += ["n/a"] * 2
        else:
            theirs = max(ecdh.sent) / r.n
            cells += [f"{theirs:.1f}", f"{ours / theirs:.2f}"]
        cells.append("n/a" if rr22 is None else per_id(rr22.sent, r.n))
        cells.append(
            f"{r.cpu_s / r.wall_s:.2f} / "
            + ("n/a" if ecdh is None else f"{ecdh.cpu_s / ecdh.wall_s:.2f}")
        )
        body.append(cells)
    return markdown(head, body)


def sql_table_md(rows: list[SqlRow]) -> str:
    head = ["cluster", "query", "rows in / out", "mp.sql s", "DuckDB alone s", "ratio", "correct"]
    body = [
        [
            r.cluster,
            f"filter + standardize {SQL_COLUMNS} f64 columns",
            f"{SQL_ROWS:,} / {r.rows_out:,}",
            f"{r.mp_sql_s:.3f}",
            f"{r.duckdb_s:.3f}",
            f"{r.mp_sql_s / r.duckdb_s:.2f}",
            "yes" if r.correct else "NO",
        ]
        for r in rows
    ]
    return markdown(head, body)


def targets(
    psi: list[PsiRow], sql: list[SqlRow], spu: dict[tuple[str, int], SpuRow] | None
) -> list[Target]:
    out = [
        Target(f"{r.cluster} mp.psi n={r.n:,}: correct, same order", r.correct, str(r.correct))
        for r in psi
    ]
    for r in psi:
        ecdh = spu.get(("ECDH-25519", r.n)) if spu else None
        if r.n == TARGET_N and ecdh is not None:
            ratio = r.wall_s / ecdh.wall_s
            out.append(
                Target(
                    f"{r.cluster} mp.psi n={r.n:,} wall <= {PSI_TARGET}x SPU ECDH-25519",
                    ratio <= PSI_TARGET,
                    f"{ratio:.2f}x",
                )
            )
    for s in sql:
        ratio = s.mp_sql_s / s.duckdb_s
        out.append(
            Target(
                f"{s.cluster} mp.sql on {SQL_ROWS:,} rows <= {SQL_TARGET}x DuckDB alone, correct",
                s.correct and ratio <= SQL_TARGET,
                f"{ratio:.2f}x",
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spu", help="psi_bench.py's --json output, for the ratios to SPU")
    ap.add_argument("--sizes", default="1e5,1e6", help="n per party, comma-separated")
    ap.add_argument("--driver", action="store_true", help="also on real party processes")
    ap.add_argument("--seed", type=int, default=0, help="the anchor's --seed")
    ap.add_argument("--json", help="write raw results here")
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    spu = load_spu(args.spu) if args.spu else None
    print(
        f"mpplug {mp.__version__} PSI/SQL benchmark: 2 parties, IDs as int64; duckdb "
        f"{duckdb.__version__}, pyarrow {pa.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} cores, load avg {os.getloadavg()}",
        flush=True,
    )
    sql = sql_table(SQL_ROWS, args.seed)
    psi: list[PsiRow] = []
    sqls: list[SqlRow] = []
    for label in ["Simulator", "Driver"][: 1 + args.driver]:
        print(f"# {label}", flush=True)
        rows, sql_row = measure(label, sizes, args.seed, sql)
        psi += rows
        sqls.append(sql_row)
    print(f"\nload avg at the end {os.getloadavg()}\n")
    print(psi_table(psi))
    print("\nSeconds in each kernel at each party (the evaluate's profile; shuffle: waiting")
    print("for a peer's value, then decoding it):\n")
    print(kernel_table(psi))
    if spu is not None:
        print("\nAgainst SPU 0.9.5 (" + args.spu + "):\n")
        print(spu_table(psi, spu))
    print("\n" + sql_table_md(sqls))
    if args.json:
        data = {"psi": [asdict(r) for r in psi], "sql": [asdict(s) for s in sqls]}
        Path(args.json).write_text(json.dumps(data, indent=1))
    return verdict(targets(psi, sqls, spu))


if __name__ == "__main__":
    sys.exit(main())
