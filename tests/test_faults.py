"""Parties that go silent without dying, stopped or cut off mid-transfer: a typed error naming
them within the timeout, healthy survivors, a working cluster after; and failing peer links.

The survivors run with one execution slot each, so an execution left running there would make
them refuse the next one. Each test starts its own party processes, not the shared pool.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from mpplug_testkernels import sleep_pfunction

import mpplug as mp
from mpplug.config import ClusterSpec
from mpplug.errors import PartyUnavailableError
from mpplug.protos import service_pb2 as pb
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.peer import PEER_SERVICE, PeerCommunicator
from mpplug.remote.status import query_status
from mpplug.remote.tls import driver_tls
from mpplug.runtime.communicator import Key, Mailbox

from .clusters import PARTY_ENV
from .netns import NAMES, Hosts, Servers, netns_hosts, write_cluster_file

TIMEOUT = 10.0
"""The driver's timeout and the parties' send timeout. A silent party is noticed in about half
of it (keepalive pings unanswered); a hang would last the execute timeout, ten times it."""

MARGIN = 10.0
"""How much later than TIMEOUT the error may come on a loaded 2-core machine."""

ONE_EXECUTION = "executes=1"

SLOW_S = 2.0
"""How long the slow step of `slow_relay` takes."""

BIG = 64 << 20
BIG_BYTES = 4 * BIG
"""The float32 value that crosses the partition: 256 MiB."""

CUT_AFTER_BYTES = 8 << 20
"""The link goes down once the sender has put this much on the wire."""


@mp.function
def slow_relay(x: mp.MPObject) -> mp.MPObject:
    """P1 gets x, works on it alone for SLOW_S seconds (a sleep), then sends it to everyone:
    P0 and P2 wait on P1 with nothing else going on."""
    (late,) = mp.run_pfunc(sleep_pfunction(SLOW_S), mp.p2p(0, 1, x))
    return mp.bcast(1, late)


@mp.function
def laps(stop: mp.MPObject) -> mp.MPObject:
    """A counter goes round P0 -> P1 -> P2 -> P0, one more each lap, until it reaches `stop`
    (given at P0); P0 tells everyone the count after each lap, so all three loop together."""
    stop = mp.bcast(0, stop)

    def more(count: mp.MPObject) -> mp.MPObject:
        return mp.run_jax(lambda c, s: c < s, count, stop)

    def lap(count: mp.MPObject) -> mp.MPObject:
        back = mp.p2p(2, 0, mp.p2p(1, 2, mp.p2p(0, 1, count)))
        return mp.bcast(0, mp.run_jax(lambda c: c + 1, back))

    return mp.while_loop(more, lap, mp.constant(np.int32(0)))


@mp.function
def hand_over(src: int | str, dst: int | str) -> mp.MPObject:
    """`src` sends its rank to `dst`: only those two take part."""
    return mp.p2p(src, dst, mp.prank(parties=[src]))


@mp.function
def big_hop() -> mp.MPObject:
    """256 MiB made at alice go to bob, who sums them and tells alice and carol."""
    big = mp.run_jax_at("alice", lambda: jnp.ones(BIG, jnp.float32))
    total = mp.run_jax(jnp.sum, mp.p2p("alice", "bob", big))
    return mp.bcast("bob", total)


@mp.function
def rank_sum(hub: str) -> mp.MPObject:
    """Everyone sends its rank to `hub`, which sends the sum back to everyone."""
    total = mp.run_jax_at(hub, lambda *ranks: sum(ranks), *mp.gather(hub, mp.prank()))
    return mp.bcast(hub, total)


@dataclass
class Fault:
    """When a fault took effect (time.monotonic()), once it has."""

    at: float | None = None

    def seconds_since(self) -> float:
        assert self.at is not None, "the fault never happened"
        return time.monotonic() - self.at


# -- a stopped process ---------------------------------------------------------------------
@dataclass
class StoppableCluster:
    """Three party processes on loopback: `victim` started as usual, the other two (the
    survivors) with one execution slot each."""

    spec: ClusterSpec
    victim: str
    launchers: tuple[LocalParties, LocalParties]

    @property
    def survivors(self) -> list[str]:
        return [name for name in self.spec.names if name != self.victim]

    @property
    def config(self) -> Path:
        return self.launchers[0].config

    def process(self, name: str) -> subprocess.Popen[bytes]:
        return next(p.processes[name] for p in self.launchers if name in p.processes)

    def logs(self) -> str:
        return "\n".join(launcher.logs() for launcher in self.launchers)


@pytest.fixture
def stoppable(tmp_path: Path) -> Iterator[StoppableCluster]:
    spec = ClusterSpec.local(3)
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(spec.to_dict()))
    victim = "P1"
    logs = tmp_path / "logs"
    survivors = LocalParties(
        config, log_dir=logs, env=PARTY_ENV, timeout=TIMEOUT, limits=[ONE_EXECUTION], fork=True
    )
    stopped = LocalParties(config, log_dir=logs, env=PARTY_ENV, timeout=TIMEOUT, fork=True)
    cluster = StoppableCluster(spec, victim, (survivors, stopped))
    try:
        survivors.start(cluster.survivors)
        stopped.start([victim])
        survivors.wait_ready(timeout=120.0, names=cluster.survivors)
        stopped.wait_ready(timeout=120.0, names=[victim])
        yield cluster
    finally:
        with contextlib.suppress(ProcessLookupError):
            cluster.process(victim).send_signal(signal.SIGCONT)
        for launcher in cluster.launchers:
            launcher.stop(grace=1.0)


@contextlib.contextmanager
def stopped_after(process: subprocess.Popen[bytes], delay: float) -> Iterator[Fault]:
    """SIGSTOP `process` `delay` seconds into the body; SIGCONT when the body ends."""
    fault = Fault()

    def stop() -> None:
        process.send_signal(signal.SIGSTOP)
        fault.at = time.monotonic()

    timer = threading.Timer(delay, stop)
    timer.start()
    try:
        yield fault
    finally:
        timer.cancel()
        timer.join()
        process.send_signal(signal.SIGCONT)


def computing_alone(driver: mp.Cluster) -> Callable[[], object]:
    """Runs `slow_relay` once; returns the call that runs it again."""
    x = driver.put(0, np.float32(7.0))
    assert [float(v) for v in driver.fetch(driver.evaluate(slow_relay, x))] == [7.0] * 3
    return lambda: driver.evaluate(slow_relay, x)


def exchanging(driver: mp.Cluster) -> Callable[[], object]:
    """Runs `laps` once; returns the call that runs it again, without end."""
    assert count_laps(driver, 3) == [3, 3, 3]
    endless = driver.put(0, np.int32(np.iinfo(np.int32).max))
    return lambda: driver.evaluate(laps, endless)


def count_laps(driver: mp.Cluster, stop: int) -> list[int]:
    return [int(v) for v in driver.fetch(driver.evaluate(laps, driver.put(0, np.int32(stop))))]


def stop_mid_run(
    cluster: StoppableCluster, driver: mp.Cluster, again: Callable[[], object]
) -> None:
    """Stop the victim a second into `again()`; check that the error names it in time and that
    the survivors are well with no execution left over; then let the victim go on."""
    spec, victim = cluster.spec, cluster.victim
    with stopped_after(cluster.process(victim), 1.0) as fault:
        with pytest.raises(PartyUnavailableError) as info:
            again()
        elapsed = fault.seconds_since()
        print(f"SIGSTOP of {victim} to {info.value!r}: {elapsed:.2f}s")
        assert info.value.party == victim, info.value
        assert elapsed < TIMEOUT + MARGIN, f"took {elapsed:.1f}s: {info.value}"

        for name in cluster.survivors:
            status = query_status(spec, name, timeout=TIMEOUT)
            assert status.serving and status.sessions == 1, status
        assert not query_status(spec, victim, timeout=1.0).serving
        # Each survivor has one execution slot: one left running would refuse this.
        first, second = cluster.survivors
        moved = driver.evaluate(hand_over, first, second)
        assert int(driver.fetch(moved, party=second)) == spec.rank_of(first)


@pytest.mark.slow
def test_a_stopped_party_is_named_within_the_timeout_and_the_others_stay_healthy(
    stoppable: StoppableCluster,
):
    try:
        # Each warm-up runs its program once (shipped, compiled, its result checked) so that
        # the stop comes mid-run, and each starts on a new Driver after the previous stop.
        for warm_up in (computing_alone, exchanging):
            with Driver(stoppable.config, timeout=TIMEOUT) as driver:
                stop_mid_run(stoppable, driver, warm_up(driver))

        with Driver(stoppable.config, timeout=TIMEOUT) as fresh:
            assert count_laps(fresh, 5) == [5, 5, 5]
    except BaseException:
        print(stoppable.logs())
        raise


# -- a network partition ---------------------------------------------------------------------
@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with netns_hosts(len(NAMES)) as built:
        yield built


@contextlib.contextmanager
def cut_when_sent(hosts: Hosts, sender: int, victim: int, nbytes: int) -> Iterator[Fault]:
    """Cut host `victim`'s link once host `sender` has sent `nbytes` more onto the bridge."""
    start = hosts.sent_bytes(sender)
    fault = Fault()
    finished = threading.Event()

    def watch() -> None:
        while not finished.wait(0.001):
            if hosts.sent_bytes(sender) - start >= nbytes:
                hosts.cut(victim)
                fault.at = time.monotonic()
                return

    watcher = threading.Thread(target=watch, name="cut-when-sent", daemon=True)
    watcher.start()
    try:
        yield fault
    finally:
        finished.set()
        watcher.join()


@pytest.mark.slow
def test_a_partition_during_a_large_transfer_names_the_party_cut_off(hosts: Hosts, tmp_path: Path):
    config = write_cluster_file(hosts, tmp_path)
    spec = ClusterSpec.from_yaml(config)
    tls = driver_tls(spec, None)
    alice, bob = 0, 1
    servers = Servers()
    try:
        one = ["--limit", ONE_EXECUTION]
        servers.start(hosts, config, timeout=TIMEOUT, options={"alice": one, "carol": one})
        servers.wait_serving(spec)
        with Driver(config, timeout=TIMEOUT) as driver:
            start = hosts.sent_bytes(alice)
            with (
                cut_when_sent(hosts, alice, bob, CUT_AFTER_BYTES) as fault,
                pytest.raises(PartyUnavailableError) as info,
            ):
                driver.evaluate(big_hop)
            elapsed = fault.seconds_since()
            print(f"partition of bob to {info.value!r}: {elapsed:.2f}s")
            assert info.value.party == "bob", info.value
            assert elapsed < TIMEOUT + MARGIN, f"took {elapsed:.1f}s: {info.value}"
            sent = hosts.sent_bytes(alice) - start
            assert sent < BIG_BYTES, f"alice sent all {sent} bytes before the cut"

            for name in ("alice", "carol"):
                status = query_status(spec, name, timeout=TIMEOUT, tls=tls)
                assert status.serving and status.sessions == 1, status
            assert not query_status(spec, "bob", timeout=1.0, tls=tls).serving
            # alice and carol have one execution slot each: one left running would refuse this.
            assert (
                int(driver.fetch(driver.evaluate(hand_over, "alice", "carol"), party="carol")) == 0
            )
            hosts.mend(bob)

        servers.wait_serving(spec)  # bob answers again once the network has caught up
        with Driver(config, timeout=TIMEOUT) as fresh:
            assert [int(v) for v in fresh.fetch(fresh.evaluate(rank_sum, "bob"))] == [3, 3, 3]
    except BaseException:
        print(servers.log_tails())
        raise
    finally:
        codes = servers.stop(grace=60.0)
    assert codes == dict.fromkeys(NAMES, 0), servers.log_tails()


# -- a connection that fails under a send ----------------------------------------------------
@contextlib.contextmanager
def flaky_peer(failures: int) -> Iterator[tuple[ClusterSpec, list[str]]]:
    """A cluster whose P1 is a PeerService that answers its first `failures` sends
    UNAVAILABLE, as a connection that died does, and accepts the rest; with what it did."""
    calls: list[str] = []

    def send_small(request: bytes, context: grpc.ServicerContext) -> bytes:
        if len(calls) < failures:
            calls.append("refused")
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost")
        calls.append("accepted")
        return pb.SendReply().SerializeToString()

    server = grpc.server(ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(send_small)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(PEER_SERVICE.full_name, {"SendSmall": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        parties = [("P0", "127.0.0.1:1"), ("P1", f"127.0.0.1:{port}")]
        data = {"parties": [{"name": name, "endpoint": at} for name, at in parties]}
        yield ClusterSpec.from_dict(data), calls
    finally:
        server.stop(0)


def send_to_p1(spec: ClusterSpec, timeout: float) -> None:
    comm = PeerCommunicator(spec, 0, Mailbox(0), tls=None, timeout=timeout)
    try:
        comm.send(Key("s:e", 1, 0, 1), np.float32(1.0))
    finally:
        comm.close()


def test_a_send_whose_connection_fails_is_tried_again_until_its_deadline():
    with flaky_peer(failures=2) as (spec, calls):
        send_to_p1(spec, timeout=5.0)
    assert calls == ["refused", "refused", "accepted"]

    with (
        flaky_peer(failures=1_000_000) as (spec, calls),
        pytest.raises(PartyUnavailableError) as info,
    ):
        send_to_p1(spec, timeout=1.0)
    assert info.value.party == "P1"
    assert "party 0 could not send s:e/1/0->1: UNAVAILABLE: connection lost" in str(info.value)
    assert len(calls) > 1 and "accepted" not in calls
