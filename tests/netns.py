"""Hosts made of network namespaces on a private bridge, each with its own address and a link
that can be cut, and `mpplug serve` for a cluster of three parties run one in each.

Needs root and a working `ip netns` (iproute2); `why_not_netns` says why not otherwise. Only the
addresses created here (a free 10.251.X.0/24 on a private bridge) are ever contacted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from mpplug import cli
from mpplug.config import ClusterSpec
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

    def link(self, host: int) -> str:
        """Host `host`'s link to the bridge (the bridge's end of its veth pair)."""
        return f"mpv{self.tag}{host}"

    def build(self, count: int) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        # Bridged frames must not meet the host firewall (Docker's FORWARD DROP, say).
        ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(count):
            namespace, outside, inside = f"mpplug-{self.tag}-{i}", self.link(i), f"mpn{i}"
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

    def cut(self, host: int) -> None:
        """Take host `host`'s link down: its packets, both ways, are dropped (nothing is
        refused or reset), as when a cable is pulled."""
        ip("link", "set", self.link(host), "down")

    def mend(self, host: int) -> None:
        ip("link", "set", self.link(host), "up")

    def sent_bytes(self, host: int) -> int:
        """Bytes host `host` has sent onto the bridge so far (frames, headers included)."""
        counter = Path("/sys/class/net") / self.link(host) / "statistics" / "rx_bytes"
        return int(counter.read_text())

    def tear_down(self) -> None:
        for namespace in self.namespaces:
            ip("netns", "del", namespace, check=False)
        for link in reversed(self.links):
            ip("link", "del", link, check=False)


@contextlib.contextmanager
def netns_hosts(count: int) -> Iterator[Hosts]:
    """`count` hosts, torn down afterwards even when the body fails; skips the test where
    namespaces cannot be made."""
    reason = why_not_netns()
    if reason is not None:
        pytest.skip(reason)
    built = Hosts(tag=str(os.getpid()), prefix=free_subnet())
    try:
        built.build(count)
        yield built
    finally:
        built.tear_down()


def write_cluster_file(hosts: Hosts, folder: Path) -> Path:
    """The cluster file as an operator writes it; then `mpplug certs` adds the tls blocks."""
    plain = folder / "cluster.yaml"
    parties = [
        {
            "name": name,
            "endpoint": f"{address}:{PORT}",
            "bulk": f"{address}:{PORT + 1}",
            "device": "cpu",
        }
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

    def start(
        self,
        hosts: Hosts,
        config: Path,
        *,
        timeout: float = 20.0,
        options: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Start every party with `--timeout timeout`, and `options[name]` for party `name`."""
        for name, namespace in zip(NAMES, hosts.namespaces, strict=True):
            self.logs[name] = config.parent / f"{name}.log"
            command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "mpplug", "serve"]
            command += ["--config", str(config), "--party", name, "--timeout", f"{timeout:g}"]
            command += list((options or {}).get(name, ()))
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
