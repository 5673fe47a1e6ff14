"""Benchmark of real parties: party-to-party transfer inside a program (over the bulk port)
next to a raw TCP connection on loopback kept open, the cached evaluate+fetch round trip
next to the Simulator, a fori_loop next to the same steps unrolled, and many drivers at once
on one cluster.

Run as `python -m bench.remote`; prints a markdown table, then PASS/FAIL per target.
"""

from __future__ import annotations

import queue
import socket
import sys
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np
import yaml

import mpplug as mp
from bench.load import remote_load, simulator_load
from bench.loops import TARGET_RATIO, loop_rows
from bench.timing import Target, side_by_side, verdict
from mpplug.config import ClusterSpec
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from simulator import Simulator

SIZES_MIB = (16, 64, 256)
TARGET_SIZE_MIB = 16
TRANSFER_REPEATS = 7
ROUND_TRIPS = 400
TARGET_GB_S = 1.5
TARGET_RAW_SHARE = 0.5
TARGET_ROUND_TRIP_MS = 2.0
TARGET_OVER_SIMULATOR = 4.0

Row = tuple[str, str, str, str]


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


class RawLink:
    """A loopback TCP connection kept open, as gRPC keeps its own: `send` moves a payload into
    a fresh buffer at the receiving thread, as a party receives it, and returns when it is in."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._sizes: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._receiver = threading.Thread(target=self._receive, daemon=True)
        self._receiver.start()
        self._conn = socket.create_connection(self._server.getsockname())

    def _receive(self) -> None:
        conn, _ = self._server.accept()
        with conn:
            while (size := self._sizes.get()) > 0:
                buffer = memoryview(np.empty(size, dtype=np.uint8))
                filled = 0
                while filled < size:
                    filled += conn.recv_into(buffer[filled:])
                self._done.put(None)

    def send(self, payload: np.ndarray) -> None:
        view = memoryview(payload.reshape(-1).view(np.uint8))
        self._sizes.put(len(view))
        self._conn.sendall(view)
        self._done.get()

    def close(self) -> None:
        self._sizes.put(0)
        self._conn.close()
        self._receiver.join()
        self._server.close()


def transfer_rows(driver: Driver, targets: list[Target]) -> list[Row]:
    rows = []
    link = RawLink()
    for mib in SIZES_MIB:
        payload = np.ones(mib * 2**20 // 4, dtype=np.float32)
        x = driver.put(0, payload)
        times = side_by_side(
            {
                "grpc": lambda x=x: driver.evaluate(move, x),
                "raw": lambda p=payload: link.send(p),
            },
            repeat=TRANSFER_REPEATS,
            warmup=1,
            rounds=1,
        )
        rate, raw = payload.nbytes / times["grpc"] / 1e9, payload.nbytes / times["raw"] / 1e9
        rows.append(
            (
                f"p2p {mib} MiB f32 inside a program",
                f"{rate:.2f} GB/s",
                f"raw TCP {raw:.2f} GB/s",
                f"{rate / raw:.0%} of raw",
            )
        )
        if mib == TARGET_SIZE_MIB:
            targets.append(
                Target(
                    f"p2p {mib} MiB >= {TARGET_GB_S} GB/s and >= {TARGET_RAW_SHARE:.0%} of raw TCP",
                    rate >= TARGET_GB_S and rate / raw >= TARGET_RAW_SHARE,
                    f"{rate:.2f} GB/s, {rate / raw:.0%}",
                )
            )
        del x
    link.close()
    return rows


def round_trips(driver: Driver, sim: Simulator) -> dict[str, float]:
    """Median seconds of evaluate+fetch for `trivial` and for `hop`, programs cached, on the
    real parties and on the Simulator, taking turns."""
    calls = {}
    for name, cluster in (("driver", driver), ("simulator", sim)):
        scalar = cluster.put(0, np.float32(1.0))
        calls[f"{name} trivial"] = lambda c=cluster: c.fetch(c.evaluate(trivial), party=0)
        calls[f"{name} hop"] = lambda c=cluster, x=scalar: c.fetch(c.evaluate(hop, x), party=2)
    return side_by_side(calls, repeat=ROUND_TRIPS, warmup=20)


def round_trip_rows(times: dict[str, float], targets: list[Target]) -> list[Row]:
    t_driver, t_sim = times["driver trivial"], times["simulator trivial"]
    over = t_driver / t_sim
    targets.append(
        Target(
            f"cached trivial 3-party evaluate+fetch < {TARGET_ROUND_TRIP_MS:g} ms and <= "
            f"{TARGET_OVER_SIMULATOR:g}x the Simulator",
            t_driver * 1e3 < TARGET_ROUND_TRIP_MS and over <= TARGET_OVER_SIMULATOR,
            f"{t_driver * 1e3:.2f} ms, {over:.1f}x",
        )
    )
    t_driver_hop, t_sim_hop = times["driver hop"], times["simulator hop"]
    return [
        (
            "evaluate+fetch, trivial 3-party program (each party computes), cached",
            f"{t_driver * 1e3:.2f} ms",
            f"Simulator {t_sim * 1e3:.2f} ms",
            f"{over:.1f}x Simulator",
        ),
        (
            "evaluate+fetch, one scalar p2p hop (party 1 idle), cached",
            f"{t_driver_hop * 1e3:.2f} ms",
            f"Simulator {t_sim_hop * 1e3:.2f} ms",
            f"{t_driver_hop / t_sim_hop:.1f}x Simulator",
        ),
    ]


def load_rows(config: Path, targets: list[Target]) -> list[Row]:
    rows = []
    for result in (remote_load(config), simulator_load()):
        rows.append(
            (
                f"load: {result.label}",
                f"{result.throughput:.0f} evaluations/s",
                f"p50 {result.p50 * 1e3:.2f} ms, p99 {result.p99 * 1e3:.2f} ms",
                f"{result.errors} errors, {result.mismatches} mixed-up results",
            )
        )
        targets.append(
            Target(
                f"load: {result.label}: 0 errors, 0 mixed-up results",
                result.errors == 0 and result.mismatches == 0,
                f"{result.errors} errors, {result.mismatches} mixed up",
            )
        )
    return rows


def main() -> int:
    targets: list[Target] = []
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="mpplug-bench-") as tmp:
        config = Path(tmp) / "cluster.yaml"
        config.write_text(yaml.safe_dump(ClusterSpec.local(3).to_dict()))
        with LocalParties(config, log_dir=Path(tmp) / "logs") as parties:
            parties.start()
            parties.wait_ready()
            with Driver(config, timeout=60.0) as driver:
                rows += transfer_rows(driver, targets)
                with Simulator(3) as sim:
                    times = round_trips(driver, sim)
                for measurement, loop, unrolled, ratio, value in loop_rows(
                    driver, "3 parties (Driver)"
                ):
                    rows.append((measurement, loop, unrolled, ratio))
                    if value is not None:
                        targets.append(
                            Target(
                                f"3 parties (Driver): fori_loop <= {TARGET_RATIO}x unrolled",
                                value <= TARGET_RATIO,
                                ratio,
                            )
                        )
            rows += load_rows(config, targets)
    rows += round_trip_rows(times, targets)

    print(f"mpplug remote benchmark (jax {jax.__version__}, 3 parties on 127.0.0.1)\n")
    print("| measurement | driver | reference | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return verdict(targets)


if __name__ == "__main__":
    sys.exit(main())
