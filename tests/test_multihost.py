"""Three parties on three "hosts": network namespaces of the test's own making, each with its
own address, running `mpplug serve` with mutual TLS from `mpplug certs`, driven from outside.

Needs root and a working `ip netns` (iproute2); skipped with the reason otherwise. Only the
addresses created here (a free 10.251.X.0/24 on a private bridge) are ever contacted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug import cli
from mpplug.config import ClusterSpec
from mpplug.demo import millionaire
from mpplug.remote.driver import Driver

from .netns import NAMES, Hosts, Servers, ip, netns_hosts, write_cluster_file


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with netns_hosts(len(NAMES)) as built:
        yield built


@mp.function
def sum_of_ranks() -> mp.MPObject:
    at_carol = mp.gather("carol", mp.prank())  # alice and bob each send to carol
    total = mp.run_jax_at("carol", lambda *ranks: sum(ranks), *at_carol)
    return mp.bcast("carol", total)  # carol sends to alice and bob


@mp.function
def spread_and_sum(v: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: jnp.sum(a, axis=0), mp.bcast("bob", v))


def run_programs(driver: mp.Cluster) -> None:
    alice = driver.put("alice", np.int64(3_000_000))
    bob = driver.put("bob", np.int64(5_000_000))
    answer = driver.evaluate(millionaire, alice, bob)  # secure: revealed to alice and bob only
    assert answer.parties == {0, 1}
    assert driver.fetch(answer)[2] is None
    assert bool(driver.fetch(answer, party="alice")) is True
    assert bool(driver.fetch(answer, party="bob")) is True

    assert [int(v) for v in driver.fetch(driver.evaluate(sum_of_ranks))] == [3, 3, 3]

    x = np.random.default_rng(0).standard_normal((3, 1 << 20)).astype(np.float32)  # 12 MiB
    for value in driver.fetch(driver.evaluate(spread_and_sum, driver.put("bob", x))):
        np.testing.assert_allclose(value, x.sum(axis=0), rtol=1e-5)


def test_three_hosts_run_programs_over_mutual_tls(
    hosts: Hosts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    config = write_cluster_file(hosts, tmp_path)
    spec = ClusterSpec.from_yaml(config)
    assert [p.host for p in spec.parties] == hosts.addresses
    for namespace, address in zip(hosts.namespaces, hosts.addresses, strict=True):
        assert f"inet {address}/24" in ip("-n", namespace, "-4", "addr").stdout

    servers = Servers()
    try:
        servers.start(hosts, config)
        servers.wait_serving(spec)

        capsys.readouterr()
        assert cli.main(["status", "--config", str(config)]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        assert [(r[0], r[2], r[3]) for r in rows] == [
            (p.name, p.endpoint, "SERVING") for p in spec.parties
        ]

        with Driver(config, timeout=20) as driver:
            run_programs(driver)
    except BaseException:
        print(servers.log_tails(), file=sys.stderr)
        raise
    finally:
        codes = servers.stop()
    assert codes == dict.fromkeys(NAMES, 0), servers.log_tails()
