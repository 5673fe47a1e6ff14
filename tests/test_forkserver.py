"""Local parties forked from a fork server (`LocalParties(fork=True)`, as the suite starts its
clusters): they serve and compute like started ones, their exits are reported as
`subprocess.Popen` reports them, a bad request leaves the server serving, and nothing outlives
a launcher killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import mpplug as mp
from mpplug.config import ClusterSpec
from mpplug.remote.driver import Driver
from mpplug.remote.launch import ForkedParty, LocalParties

from .clusters import PARTY_ENV

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads process parents from /proc"
)


def _cluster_file(folder: Path, world_size: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump(ClusterSpec.local(world_size).to_dict()))
    return config


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"


@mp.function
def _twice_plus_one(x: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: a * 2 + 1, mp.p2p(0, 1, x))


def test_forked_parties_compute_and_share_one_fork_server_per_environment(tmp_path: Path):
    first = LocalParties(
        _cluster_file(tmp_path / "a", 2), log_dir=tmp_path / "a", env=PARTY_ENV, fork=True
    )
    second = LocalParties(
        _cluster_file(tmp_path / "b", 2), log_dir=tmp_path / "b", env=PARTY_ENV, fork=True
    )
    with first, second:
        first.start()
        second.start()
        first.wait_ready(timeout=60)
        second.wait_ready(timeout=60)
        processes = [*first.processes.values(), *second.processes.values()]
        assert all(isinstance(p, ForkedParty) for p in processes)
        servers = {_parent(p.pid) for p in processes}
        assert len(servers) == 1 and os.getpid() not in servers
        (server,) = servers
        assert b"mpplug.remote.forkserver" in Path(f"/proc/{server}/cmdline").read_bytes()
        environ = Path(f"/proc/{processes[0].pid}/environ").read_bytes()
        assert b"MPPLUG_TIER_UP_AFTER_S=0.05\0" in environ  # `env` reached the party
        with Driver(first.config, timeout=30.0) as driver:
            got = driver.fetch(driver.evaluate(_twice_plus_one, driver.put(0, np.arange(4.0))), 1)
        np.testing.assert_array_equal(got, [1.0, 3.0, 5.0, 7.0])
    assert [p.returncode for p in processes] == [0, 0, 0, 0]  # SIGTERM: a clean shutdown
    assert "SIGTERM, shutting down" in first.log("P0")


def test_a_killed_party_reports_its_signal_and_its_peers_keep_serving(tmp_path: Path):
    with LocalParties(
        _cluster_file(tmp_path, 3), log_dir=tmp_path / "logs", env=PARTY_ENV, fork=True
    ) as parties:
        parties.start()
        parties.wait_ready(timeout=60)
        victim = parties.processes["P1"]
        assert victim.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            victim.wait(0.1)
        parties.kill("P1")
        assert victim.poll() == -signal.SIGKILL and victim.wait(0) == -signal.SIGKILL
        assert _gone(victim.pid)
        assert not parties.alive()
        parties.wait_ready(timeout=10, names=["P0", "P2"])


def test_parties_started_without_fork_are_fresh_interpreters(tmp_path: Path):
    with LocalParties(
        _cluster_file(tmp_path, 2), log_dir=tmp_path / "logs", env=PARTY_ENV, fork=False
    ) as parties:
        parties.start(["P0"])
        parties.wait_ready(timeout=60, names=["P0"])
        process = parties.processes["P0"]
        assert isinstance(process, subprocess.Popen)
        assert _parent(process.pid) == os.getpid()
        assert b"mpplug.remote.server" in Path(f"/proc/{process.pid}/cmdline").read_bytes()


def _send(server: subprocess.Popen[bytes], request: object) -> dict[str, object]:
    assert server.stdin is not None and server.stdout is not None
    line = request if isinstance(request, bytes) else json.dumps(request).encode()
    server.stdin.write(line + b"\n")
    server.stdin.flush()
    return dict(json.loads(server.stdout.readline()))


def test_the_fork_server_refuses_bad_requests_and_reports_exit_codes(tmp_path: Path):
    server = subprocess.Popen(
        [sys.executable, "-m", "mpplug.remote.forkserver"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **PARTY_ENV},
    )
    try:
        request = {"argv": ["--version"], "log": str(tmp_path / "p.log"), "env": {}, "cwd": "/"}
        for bad, why in [
            (b"{not json", "JSONDecodeError"),
            ({"argv": ["--version"]}, "KeyError: 'log'"),
            ({**request, "env": [1, 2]}, "TypeError"),
            ({**request, "log": str(tmp_path / "absent" / "p.log")}, "FileNotFoundError"),
        ]:
            reply = _send(server, bad)
            assert str(reply.get("failed", "")).startswith("bad request: " + why), reply
        config = _cluster_file(tmp_path, 2)
        for argv, code in [
            (["--config", str(tmp_path / "absent.yaml"), "--party", "P0"], 2),  # config error
            (["--config", str(config), "--party", "P9"], 2),
        ]:
            started = _send(server, {**request, "argv": argv})
            assert isinstance(started.get("started"), int), started
            assert server.stdout is not None
            exited = json.loads(server.stdout.readline())
            assert exited == {"exited": started["started"], "code": code}
        assert "no party named 'P9'" in (tmp_path / "p.log").read_text()
    finally:
        server.kill()
        server.wait()


_LAUNCHER = """
import sys, time
from mpplug.remote.launch import LocalParties
parties = LocalParties(sys.argv[1], log_dir=sys.argv[2], fork=True)
parties.start()
parties.wait_ready(timeout=60)
print(" ".join(str(p.pid) for p in parties.processes.values()), flush=True)
time.sleep(600)
"""


def test_no_party_outlives_a_launcher_killed_with_sigkill(tmp_path: Path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(_cluster_file(tmp_path, 2)), str(tmp_path)],
        stdout=subprocess.PIPE,
        env={**os.environ, **PARTY_ENV},
    )
    pids: list[int] = []
    try:
        assert launcher.stdout is not None
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 2
        pids.append(_parent(pids[0]))  # the fork server
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids), [p for p in pids if not _gone(p)]
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
