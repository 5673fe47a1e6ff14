"""Three parties on three "hosts": network namespaces of the test's own making, each with its
own address, running `mpplug serve` with mutual TLS from `mpplug certs`, driven from outside.

Needs root and a working `ip netns` (iproute2); skipped with the reason otherwise. Only the
addresses created here (a free 10.251.X.0/24 on a private bridge) are ever contacted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import mpplug as mp
from mpplug import cli
from mpplug.config import ClusterSpec
from mpplug.demo import millionaire
from mpplug.remote.driver import Driver
from mpplug.remote.launch import stop_processes
from mpplug.remote.status import query_status
from mpplug.remote.tls import driver_tls

NAMES = ("alice", "bob", "carol")
PORT = 7100
"""Every party listens on the same port, each on its own address, as on real hosts."""
READY_S = 120.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def why_not_netns() -> str | None:
    """Why this machine cannot run the test, or None if it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    probe = f"mpplug-probe-{os.getpid()}"
    added = ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` does not work here: {added.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    bridge = f"mpprobe{os.getpid()}"
    added = ip("link", "add", bridge, "type", "bridge", check=False)
    if added.returncode != 0:
        return f"`ip link add ... type bridge` does not work here: {added.stderr.strip()}"
    ip("link", "del", bridge, check=False)
    return None


def free_subnet() -> str:
    """A 10.251.X prefix that no address or route on this machine uses yet."""
    used = ip("-4", "addr").stdout + ip("-4", "route").stdout
    for step in range(256):
        prefix = f"10.251.{(os.getpid() + step) % 254 + 1}"
        if f"{prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.251.X.0/24 on this machine")


@dataclass
class Hosts:
    """Namespaces on one bridge; `addresses[i]` is host i's address."""

    tag: str
    prefix: str
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"mpbr{self.tag}"

    def build(self, count: int) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        # Bridged frames must not meet the host firewall (Docker's FORWARD DROP, say).
        ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(count):
            namespace, outside, inside = f"mpplug-{self.tag}-{i}", f"mpv{self.tag}{i}", f"mpn{i}"
            address = f"{self.prefix}.{11 + i}"
            ip("netns", "add", namespace)
            self.namespaces.append(namespace)
            ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self.links.append(outside)
            ip("link", "set", inside, "netns", namespace)
            ip("link", "set", outside, "master", self.bridge)
            ip("link", "set", outside, "up")
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
            ip("-n", namespace, "link", "set", inside, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
            self.addresses.append(address)

    def tear_down(self) -> None:
        for namespace in self.namespaces:
            ip("netns", "del", namespace, check=False)
        for link in reversed(self.links):
            ip("link", "del", link, check=False)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = why_not_netns()
    if reason is not None:
        pytest.skip(reason)
    built = Hosts(tag=str(os.getpid()), prefix=free_subnet())
    try:
        built.build(len(NAMES))
        yield built
    finally:
        built.tear_down()


def write_cluster_file(hosts: Hosts, folder: Path) -> Path:
    """The cluster file as an operator writes it; then `mpplug certs` adds the tls blocks."""
    plain = folder / "cluster.yaml"
    parties = [
        {"name": name, "endpoint": f"{address}:{PORT}", "device": "cpu"}
        for name, address in zip(NAMES, hosts.addresses, strict=True)
    ]
    plain.write_text(yaml.safe_dump({"parties": parties}, sort_keys=False))
    assert cli.main(["certs", "--config", str(plain), "--out", str(folder / "certs")]) == 0
    return folder / "certs" / "cluster.yaml"


@dataclass
class Servers:
    """`mpplug serve` for each party, inside its own namespace."""

    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def start(self, hosts: Hosts, config: Path) -> None:
        for name, namespace in zip(NAMES, hosts.namespaces, strict=True):
            self.logs[name] = config.parent / f"{name}.log"
            command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "mpplug", "serve"]
            command += ["--config", str(config), "--party", name, "--timeout", "20"]
            with open(self.logs[name], "wb") as out:
                self.processes[name] = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT
                )

    def wait_serving(self, spec: ClusterSpec) -> None:
        """Until each party reports SERVING to a client in the root namespace."""
        tls = driver_tls(spec, None)
        deadline = time.monotonic() + READY_S
        for name in NAMES:
            while not query_status(spec, name, timeout=1.0, tls=tls).serving:
                exited = self.processes[name].poll()
                if exited is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"party {name} is not serving (exit code {exited}):\n{self.log_tails()}"
                    )
                time.sleep(0.1)

    def stop(self, grace: float = 15.0) -> dict[str, int]:
        """SIGTERM each, SIGKILL any still running after `grace`; their exit codes."""
        stop_processes(self.processes.values(), grace)
        return {name: p.returncode for name, p in self.processes.items()}

    def log_tails(self) -> str:
        return "\n".join(
            f"--- {name} ---\n{path.read_text(errors='replace')[-3000:]}"
            for name, path in self.logs.items()
        )


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
