"""Cluster kinds the conformance suite runs against, and how to make each.

Each kind is a context manager factory `(world_size, timeout) -> Cluster`; every kind must
give identical results on the same program. The "driver" kind runs real party processes on
free loopback ports; they are pooled across tests (a fresh Driver session per test).
`in_process` runs party servers inside the test process, for tests that set their limits.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from mpplug import Cluster
from mpplug.config import ClusterSpec
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.certs import with_tls, write_dev_certs
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.rpc import WIRE_VERSION
from mpplug.remote.server import PartyServer
from simulator import Simulator

PLUGIN_DIR = Path(__file__).parent / "plugins"
PARTY_ENV = {
    "PYTHONPATH": os.pathsep.join(p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH")) if p),
    "MPPLUG_TIER_UP_AFTER_S": "0.05",  # tests' programs are quick: compile them after a few runs
}
POOLED_CLUSTERS = 3
"""Party clusters kept running per test process (each party is a JAX process, ~250 MB)."""
SWEEP_PARTIES = 3
"""A cluster of more parties than this serves a world-size sweep's few tests: it runs until
another cluster is asked for, and takes no small one's place."""


def start_parties(workdir: Path, world_size: int, *, tls: bool = False) -> LocalParties:
    """Write a cluster file for `world_size` parties on free loopback ports (with dev
    certificates if `tls`), start one server process per party and wait until all serve."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec.local(world_size)
    if tls:
        spec = with_tls(spec, write_dev_certs(spec, workdir / "certs"))
    config = workdir / "cluster.yaml"
    config.write_text(yaml.safe_dump(spec.to_dict()))
    parties = LocalParties(config, log_dir=workdir / "logs", env=PARTY_ENV, fork=True)
    try:
        parties.start()
        parties.wait_ready(timeout=120.0)
    except BaseException:
        parties.stop(grace=0.0)
        raise
    return parties


class PartyPool:
    """Running party clusters by (world size, tls), at most `capacity` of up to SWEEP_PARTIES
    parties, the least recently used stopped first; a bigger one runs until another is asked
    for, and takes no small one's place."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._clusters: collections.OrderedDict[tuple[int, bool], LocalParties] = (
            collections.OrderedDict()
        )
        self._root: Path | None = None
        self._started = 0

    def get(self, world_size: int, *, tls: bool = False) -> LocalParties:
        key = (world_size, tls)
        for other in [k for k in self._clusters if k != key and k[0] > SWEEP_PARTIES]:
            self._clusters.pop(other).stop(grace=0.0)
        parties = self._clusters.pop(key, None)
        if parties is not None and not parties.alive():
            parties.stop(grace=0.0)
            parties = None
        if parties is None:
            while world_size <= SWEEP_PARTIES and len(self._clusters) >= self.capacity:
                self._clusters.popitem(last=False)[1].stop(grace=0.0)
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="mpplug-parties-"))
            self._started += 1
            workdir = self._root / f"{self._started}-{world_size}{'-tls' if tls else ''}"
            parties = start_parties(workdir, world_size, tls=tls)
        self._clusters[key] = parties
        return parties

    def close(self) -> None:
        while self._clusters:
            self._clusters.popitem()[1].stop(grace=0.0)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


POOL = PartyPool(POOLED_CLUSTERS)
atexit.register(POOL.close)


@contextlib.contextmanager
def driven(parties: LocalParties, timeout: float) -> Iterator[Driver]:
    """A Driver session on `parties`; prints the parties' logs if the body fails."""
    try:
        with Driver(parties.config, timeout=timeout) as driver:
            yield driver
    except BaseException:
        print(f"party logs ({parties.log_dir}):\n{parties.logs()}", file=sys.stderr)
        raise


@contextlib.contextmanager
def in_process(
    spec: ClusterSpec, names: Sequence[str] | None = None, **options: Any
) -> Iterator[list[PartyServer]]:
    """Party servers for `names` of `spec` (default: all) in this process, with `options`
    for PartyServer; each is stopped afterwards, even when the body fails."""
    with contextlib.ExitStack() as stack:
        servers = []
        for name in names if names is not None else spec.names:
            server = PartyServer(spec, name, **options)
            server.start()
            stack.callback(server.stop, 0.0)
            servers.append(server)
        yield servers


@contextlib.contextmanager
def lone_p0(spec: ClusterSpec, **options: Any) -> Iterator[rpc_pb.PartyServiceStub]:
    """P0 of `spec` alone in this process (the other parties never start), with `options` for
    PartyServer, and a stub to it with a session "s1" open."""
    with (
        in_process(spec, ["P0"], **options),
        grpc.insecure_channel(spec.parties[0].endpoint) as channel,
    ):
        stub = rpc_pb.PartyServiceStub(channel)
        stub.OpenSession(
            pb.OpenSessionRequest(session="s1", parties=spec.names, wire_version=WIRE_VERSION),
            timeout=5.0,
        )
        yield stub


@contextlib.contextmanager
def simulator_cluster(world_size: int, timeout: float) -> Iterator[Cluster]:
    with Simulator(world_size, timeout=timeout) as sim:
        yield sim


@contextlib.contextmanager
def driver_cluster(world_size: int, timeout: float) -> Iterator[Cluster]:
    with driven(POOL.get(world_size), timeout) as driver:
        yield driver


@contextlib.contextmanager
def driver_tls_cluster(world_size: int, timeout: float) -> Iterator[Cluster]:
    with driven(POOL.get(world_size, tls=True), timeout) as driver:
        yield driver


KINDS: dict[str, Callable[[int, float], contextlib.AbstractContextManager[Cluster]]] = {
    "simulator": simulator_cluster,
    "driver": driver_cluster,
}
