"""Benchmark of real parties over gRPC: party-to-party transfer inside a program next to a raw
TCP socket on loopback, the cached evaluate+fetch round trip next to the Simulator, and a
fori_loop next to the same steps unrolled."""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and bench/simulator.py would
# shadow the `simulator` package; drop that entry before importing it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench.loops

import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

import mpplug as mp  # noqa: E402
from bench.loops import loop_rows  # noqa: E402
from mpplug.config import ClusterSpec  # noqa: E402
from mpplug.remote.driver import Driver  # noqa: E402
from mpplug.remote.launch import LocalParties  # noqa: E402
from simulator import Simulator  # noqa: E402

SIZES_MIB = (16, 64, 256)
TRANSFER_REPEATS = 7
ROUND_TRIPS = 300
TARGET_MB_S = 800.0
TARGET_RAW_SHARE = 0.25
TARGET_ROUND_TRIP_MS = 5.0


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@mp.function
def move(x: mp.MPObject) -> mp.MPObject:
    return mp.p2p(0, 1, x)


@mp.function
def trivial() -> mp.MPObject:
    """Every party adds one to its rank."""
    return mp.run_jax(lambda r: r + 1, mp.prank())


@mp.function
def hop(x: mp.MPObject) -> mp.MPObject:
    """Party 0 adds one to a scalar and hands it to party 2."""
    return mp.p2p(0, 2, mp.run_jax(lambda a: a + 1, x))


def round_trips(cluster: mp.Cluster) -> tuple[float, float]:
    """Median seconds of evaluate+fetch for `trivial` and for `hop`, programs cached."""
    scalar = cluster.put(0, np.float32(1.0))
    t_trivial = median_seconds(
        lambda: cluster.fetch(cluster.evaluate(trivial), party=0), ROUND_TRIPS, warmup=20
    )
    t_hop = median_seconds(
        lambda: cluster.fetch(cluster.evaluate(hop, scalar), party=2), ROUND_TRIPS, warmup=20
    )
    return t_trivial, t_hop


def raw_socket_seconds(payload: np.ndarray) -> float:
    """One loopback TCP transfer of `payload` into a fresh buffer, as a party receives it."""
    view = memoryview(payload.reshape(-1).view(np.uint8))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def receive() -> None:
            conn, _ = server.accept()
            with conn:
                buffer = memoryview(np.empty(len(view), dtype=np.uint8))
                filled = 0
                while filled < len(view):
                    filled += conn.recv_into(buffer[filled:])

        receiver = threading.Thread(target=receive)
        receiver.start()
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(view)
            receiver.join()
        return time.perf_counter() - start


def main() -> int:
    rows: list[tuple[str, str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="mpplug-bench-") as tmp:
        config = Path(tmp) / "cluster.yaml"
        config.write_text(yaml.safe_dump(ClusterSpec.local(3).to_dict()))
        with LocalParties(config, log_dir=Path(tmp) / "logs") as parties:
            parties.start()
            parties.wait_ready()
            with Driver(config, timeout=60.0) as driver:
                for mib in SIZES_MIB:
                    payload = np.ones(mib * 2**20 // 4, dtype=np.float32)
                    x = driver.put(0, payload)
                    t_grpc = median_seconds(lambda x=x: driver.evaluate(move, x), TRANSFER_REPEATS)
                    t_raw = median_seconds(
                        lambda p=payload: raw_socket_seconds(p), TRANSFER_REPEATS
                    )
                    grpc_rate = payload.nbytes / t_grpc / 1e6
                    raw_rate = payload.nbytes / t_raw / 1e6
                    share = grpc_rate / raw_rate
                    verdict = ""
                    if mib == SIZES_MIB[-1]:
                        ok = grpc_rate >= TARGET_MB_S and share >= TARGET_RAW_SHARE
                        verdict = "PASS" if ok else "FAIL"
                    rows.append(
                        (
                            f"p2p {mib} MiB f32 inside a program",
                            f"{grpc_rate:.0f} MB/s",
                            f"raw TCP {raw_rate:.0f} MB/s",
                            f"{share:.0%} of raw",
                            f"{verdict} (>= {TARGET_MB_S:.0f} MB/s, >= {TARGET_RAW_SHARE:.0%})"
                            if verdict
                            else "",
                        )
                    )
                    del x

                t_driver, t_driver_hop = round_trips(driver)
                rows.extend(loop_rows(driver, "3 parties over gRPC"))
    with Simulator(3) as sim:
        t_sim, t_sim_hop = round_trips(sim)
    ok = t_driver * 1e3 < TARGET_ROUND_TRIP_MS
    rows.append(
        (
            "evaluate+fetch, trivial 3-party program (each party computes), cached",
            f"{t_driver * 1e3:.2f} ms",
            f"Simulator {t_sim * 1e3:.2f} ms",
            f"{t_driver / t_sim:.1f}x Simulator",
            f"{'PASS' if ok else 'FAIL'} (< {TARGET_ROUND_TRIP_MS:g} ms)",
        )
    )
    rows.append(
        (
            "evaluate+fetch, one scalar p2p hop (party 1 idle), cached",
            f"{t_driver_hop * 1e3:.2f} ms",
            f"Simulator {t_sim_hop * 1e3:.2f} ms",
            f"{t_driver_hop / t_sim_hop:.1f}x Simulator",
            "",
        )
    )

    print(f"mpplug remote benchmark (jax {jax.__version__}, 3 parties on 127.0.0.1)\n")
    print("| measurement | driver | reference | ratio | target |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if any(row[4].startswith("FAIL") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
