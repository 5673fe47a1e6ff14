"""Parties that die: a typed error naming the party within the timeout, healthy survivors,
and a working cluster again once the party is back.

Each test starts its own party processes (they get killed), not the shared pool.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from mpplug_testkernels import sleep_pfunction

import mpplug as mp
from mpplug.errors import PartyUnavailableError
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.status import query_status

from .clusters import start_parties

TIMEOUT = 15.0


@pytest.fixture
def parties(tmp_path) -> Iterator[LocalParties]:
    parties = start_parties(tmp_path / "cluster", 3)
    try:
        yield parties
    except BaseException:
        print(parties.logs())
        raise
    finally:
        parties.stop(grace=1.0)


@mp.function
def sleepy_relay(x: mp.MPObject) -> mp.MPObject:
    """Party 1 gets x, sleeps 30 s, then sends it on to everyone: 0 and 2 wait on party 1."""
    (late,) = mp.run_pfunc(sleep_pfunction(30.0), mp.p2p(0, 1, x))
    return mp.bcast(1, late)


@mp.function
def rank_sum() -> mp.MPObject:
    total = mp.run_jax_at(1, lambda *r: sum(r), *mp.gather(1, mp.prank()))
    return mp.bcast(1, total)


def test_killing_a_party_mid_run_names_it_within_the_timeout_and_it_can_come_back(parties):
    with Driver(parties.config, timeout=TIMEOUT) as driver:
        x = driver.put(0, np.float32(7.0))
        killer = threading.Timer(2.0, parties.kill, args=("P1", signal.SIGKILL))
        start = time.monotonic()
        killer.start()
        try:
            with pytest.raises(PartyUnavailableError) as info:
                driver.evaluate(sleepy_relay, x)
        finally:
            killer.join()
        elapsed = time.monotonic() - start
        assert info.value.party == "P1"
        assert elapsed < TIMEOUT, f"took {elapsed:.1f}s"

        for name in ("P0", "P2"):
            assert query_status(parties.spec, name).serving, parties.log(name)
        assert float(driver.fetch(x, party=0)) == 7.0  # the survivors kept this session
        assert not query_status(parties.spec, "P1").serving

        parties.start(["P1"])
        parties.wait_ready(names=["P1"])
        with pytest.raises(PartyUnavailableError) as again:
            driver.evaluate(rank_sum)  # this session's values at P1 are gone with it
        assert again.value.party == "P1"

    with Driver(parties.config, timeout=TIMEOUT) as fresh:
        assert [int(v) for v in fresh.fetch(fresh.evaluate(rank_sum))] == [3, 3, 3]


def test_a_party_that_is_down_is_named_when_a_driver_connects(parties):
    parties.kill("P2", signal.SIGTERM)
    assert parties.processes["P2"].returncode == 0, parties.log("P2")
    assert "SIGTERM, shutting down" in parties.log("P2")
    start = time.monotonic()
    with pytest.raises(PartyUnavailableError) as info:
        Driver(parties.config, timeout=TIMEOUT)
    assert info.value.party == "P2"
    assert time.monotonic() - start < TIMEOUT
    for name in ("P0", "P1"):
        status = query_status(parties.spec, name)
        assert status.serving and status.sessions == 0  # the half-open session was closed
