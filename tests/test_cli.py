"""The `mpplug` command line, run for real in subprocesses: demo, certs, up, status, serve,
and its one-line errors. Every process a test starts is killed at teardown, even on failure."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import queue
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

import mpplug
from mpplug.cli import main
from mpplug.config import ClusterSpec, free_port
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.certs import with_tls, write_dev_certs
from mpplug.remote.rpc import WIRE_VERSION

from .clusters import in_process

CLI = [sys.executable, "-m", "mpplug"]
READY_S = 90.0
"""Parties import JAX when they start: about 2 s alone, longer on a busy 2-core machine."""
STOP_S = 20.0


# -- helpers ----------------------------------------------------------------------------------
def run_cli(*args: str | Path, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def write_cluster(folder: Path, names: list[str]) -> Path:
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(ClusterSpec.local(names).to_dict()))
    return path


def server_pids(marker: str) -> set[int]:
    """Live party server processes whose command line mentions `marker` (from /proc)."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if marker.encode() in cmdline and b"mpplug.remote.server" in cmdline:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return ""


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true after {timeout:g}s")
        time.sleep(0.1)


def health(endpoint: str, timeout: float = 2.0) -> str:
    """The grpc.health.v1 status of the server at `endpoint`, or the RPC error code."""
    with grpc.insecure_channel(endpoint, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as exc:
            return exc.code().name if isinstance(exc, grpc.Call) else type(exc).__name__
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class Spawned:
    """A CLI process with its output read line by line in the background."""

    def __init__(self, *args: str | Path) -> None:
        self.process = subprocess.Popen(
            [*CLI, *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = READY_S) -> str:
        """The first new line matching `pattern`; AssertionError with the output otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}:\n{self.output()}") from None
            if line is None:
                raise AssertionError(
                    f"exited ({self.process.poll()}) before {pattern!r}:\n{self.output()}"
                )
            self.lines.append(line)
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float = STOP_S) -> int:
        """Wait for the exit code; the rest of the output lands in `lines`."""
        code = self.process.wait(timeout)
        while (line := self._queue.get(timeout=5)) is not None:
            self.lines.append(line)
        return code

    def output(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[type[Spawned]]:
    """Starts CLI processes; at teardown kills them and any party server whose command line
    mentions this test's folder, whatever the test's outcome."""
    started: list[Spawned] = []

    class Tracked(Spawned):
        def __init__(self, *args: str | Path) -> None:
            super().__init__(*args)
            started.append(self)

    try:
        yield Tracked
    finally:
        for spawned in started:
            spawned.kill()
        for pid in server_pids(str(tmp_path)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- usage ------------------------------------------------------------------------------------
def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("serve", "up", "status", "demo", "certs"):
        assert re.search(rf"^\s+{command}\s", out, re.MULTILINE), out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]):
    assert main([]) == 2
    assert "mpplug: error: the following arguments are required: COMMAND" in capsys.readouterr().err


def test_the_console_script_runs():
    script = Path(sys.executable).parent / "mpplug"
    if not script.exists():
        pytest.skip(f"no console script at {script} (package not installed with pip)")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, f"mpplug {mpplug.__version__}"), (
        done.stderr
    )


# -- configuration errors ---------------------------------------------------------------------
def test_bad_config_exits_2_with_one_line_and_no_traceback(tmp_path: Path):
    config = tmp_path / "cluster.yaml"
    config.write_text("parties:\n  - {name: alice, endpoint: 'alice.example'}\n")
    done = run_cli("serve", "--config", config, "--party", "alice")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip() == (
        f"mpplug: error: {config}.parties[0].endpoint: expected 'host:port', "
        "got 'alice.example' (no port)"
    )


@pytest.mark.parametrize(
    "command",
    [["serve", "--party", "alice"], ["up"], ["status"], ["certs", "--out", "certs"]],
    ids=lambda c: c[0],
)
def test_every_command_reports_a_missing_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
):
    missing = tmp_path / "missing.yaml"
    assert main([command[0], "--config", str(missing), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert err == f"mpplug: error: cannot read cluster file {missing}: No such file or directory\n"


def test_serve_names_an_unknown_party(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = write_cluster(tmp_path, ["alice", "bob"])
    assert main(["serve", "--config", str(config), "--party", "carol"]) == 2
    assert capsys.readouterr().err == (
        f"mpplug: error: {config}: no party named 'carol'; parties: ['alice', 'bob']\n"
    )


# -- demo -------------------------------------------------------------------------------------
def test_demo_runs_the_quickstart():
    done = run_cli("demo")
    assert done.returncode == 0, done.stderr
    assert "program millionaire(world_size=3)" in done.stdout
    assert "Is Bob richer than Alice? True" in done.stdout


# -- certs ------------------------------------------------------------------------------------
def test_certs_writes_a_ca_and_party_certificates_naming_their_hosts(tmp_path: Path):
    config = tmp_path / "cluster.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "parties": [
                    {"name": "alice", "endpoint": "alice.mpc.example:7000"},
                    {"name": "bob", "endpoint": "10.9.8.7:7000", "listen": "10.9.8.70:7000"},
                    {"name": "carol", "endpoint": "[fd00::3]:7000", "device": "cpu"},
                ]
            }
        )
    )
    out = tmp_path / "certs"
    done = run_cli("certs", "--config", config, "--out", out)
    assert done.returncode == 0, done.stderr
    for name in ("ca", "alice", "bob", "carol", "driver"):
        assert f"{name}.pem, {name}.key" in done.stdout

    def load(name: str) -> x509.Certificate:
        return x509.load_pem_x509_certificate((out / f"{name}.pem").read_bytes())

    def sans(cert: x509.Certificate) -> set[str]:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(n.value) for n in names}

    ca = load("ca")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    expected = {
        "alice": {"alice.mpc.example"},
        "bob": {str(ipaddress.ip_address("10.9.8.7")), "10.9.8.70"},
        "carol": {"fd00::3"},
    }
    for name, hosts in expected.items():
        cert = load(name)
        cert.verify_directly_issued_by(ca)
        assert cert.subject.rfc4514_string() == f"CN={name}"
        assert sans(cert) == hosts
        assert stat.S_IMODE((out / f"{name}.key").stat().st_mode) == 0o600
    load("driver").verify_directly_issued_by(ca)
    ips = load("bob").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.9.8.7") in ips.get_values_for_type(x509.IPAddress)

    # The copy of the cluster file points each party at its own files, relative to `out`.
    spec = ClusterSpec.from_yaml(out / "cluster.yaml")
    assert spec.names == ["alice", "bob", "carol"]
    assert spec.party("bob").listen == "10.9.8.70:7000"
    assert spec.party("carol").device == "cpu"
    carol_tls = spec.party("carol").tls
    assert carol_tls is not None
    assert carol_tls.cert == (out / "carol.pem").resolve()
    assert yaml.safe_load((out / "cluster.yaml").read_text())["parties"][0]["tls"] == {
        "ca": "ca.pem",
        "cert": "alice.pem",
        "key": "alice.key",
    }


def test_certs_for_loopback_parties_name_localhost(tmp_path: Path):
    config = write_cluster(tmp_path, ["alice", "bob"])
    assert main(["certs", "--config", str(config), "--out", str(tmp_path / "certs")]) == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "certs" / "alice.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)


def test_certs_will_not_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = write_cluster(tmp_path, ["alice", "bob"])
    out = tmp_path / "certs"
    assert main(["certs", "--config", str(config), "--out", str(out)]) == 0
    first = (out / "ca.pem").read_bytes()
    capsys.readouterr()
    assert main(["certs", "--config", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpplug: error: {out} already holds ['alice.key', 'alice.pem', ")
    assert err.endswith("pass --force to overwrite them\n")
    assert (out / "ca.pem").read_bytes() == first
    assert main(["certs", "--config", str(config), "--out", str(out), "--force"]) == 0
    assert (out / "ca.pem").read_bytes() != first


def test_certs_into_a_file_is_a_runtime_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = write_cluster(tmp_path, ["alice", "bob"])
    not_a_folder = tmp_path / "certs"
    not_a_folder.write_text("")
    assert main(["certs", "--config", str(config), "--out", str(not_a_folder)]) == 1
    assert capsys.readouterr().err == f"mpplug: error: [Errno 17] File exists: '{not_a_folder}'\n"


# -- up and status ----------------------------------------------------------------------------
def start_up(
    spawn: type[Spawned], config: Path, log_dir: Path, *options: str
) -> tuple[Spawned, dict[str, int]]:
    """`mpplug up` serving; returns it and the party pids it printed."""
    up = spawn("up", "--config", config, "--log-dir", log_dir, "--timeout", "10", *options)
    up.wait_for(r"parties serving")
    pids = {}
    for line in up.lines:
        match = re.match(r"(\w+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)$", line)
        if match:
            pids[match.group(1)] = int(match.group(5))
    return up, pids


@pytest.mark.slow
def test_up_serves_every_party_and_sigterm_stops_them_all(tmp_path: Path, spawn: type[Spawned]):
    config = write_cluster(tmp_path, ["alice", "bob"])
    spec = ClusterSpec.from_yaml(config)
    up, pids = start_up(spawn, config, tmp_path / "logs", "--session-idle-timeout", "45")
    assert set(pids) == {"alice", "bob"}, up.output()
    assert set(pids.values()) == server_pids(str(config))
    for rank, party in enumerate(spec.parties):
        line = next(x for x in up.lines if x.startswith(f"{party.name} "))
        assert line.split()[:4] == [party.name, str(rank), party.listen, party.endpoint]
        assert health(party.endpoint) == "SERVING"
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "1")  # the parties share this host's cores
    for pid in pids.values():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"OPENBLAS_NUM_THREADS={blas}".encode() in environ

    status = run_cli("status", "--config", config)
    assert status.returncode == 0, status.stdout + status.stderr
    rows = [line.split() for line in status.stdout.splitlines()[1:]]
    assert [row[:5] for row in rows] == [
        [p.name, str(rank), p.endpoint, "SERVING", "0"] for rank, p in enumerate(spec.parties)
    ]

    up.process.send_signal(signal.SIGTERM)
    assert up.finish() == 0, up.output()
    assert "SIGTERM: stopping 2 parties" in up.lines
    assert up.lines[-1] == "all parties stopped"
    assert not [pid for pid in pids.values() if alive(pid)]
    assert not server_pids(str(config))
    assert health(spec.parties[0].endpoint, timeout=0.5) == "UNAVAILABLE"
    assert "idle sessions close after 45s" in (tmp_path / "logs" / "alice.log").read_text()


def test_up_stops_the_rest_when_a_party_dies(tmp_path: Path, spawn: type[Spawned]):
    config = write_cluster(tmp_path, ["alice", "bob"])
    up, pids = start_up(spawn, config, tmp_path / "logs")
    os.kill(pids["bob"], signal.SIGKILL)
    assert up.finish() == 1, up.output()
    assert "mpplug: error: party bob exited unexpectedly with code -9" in up.output()
    wait_until(lambda: not alive(pids["alice"]), STOP_S, "alice stopped")


def test_up_fails_when_a_party_cannot_listen(tmp_path: Path, spawn: type[Spawned]):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        alice = f"127.0.0.1:{free_port()}"
        config = tmp_path / "cluster.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "parties": [
                        {  # first, so that `up` notices at once when it exits
                            "name": "bob",
                            "endpoint": f"127.0.0.1:{port}",
                            "listen": f"127.0.0.1:{port}",
                        },
                        {
                            "name": "alice",
                            "endpoint": (alice := f"127.0.0.1:{free_port()}"),
                            "listen": alice,
                        },
                    ]
                }
            )
        )
        up = spawn("up", "--config", config, "--log-dir", tmp_path / "logs")
        assert up.finish(READY_S) == 1, up.output()
    assert "mpplug: error: party bob is not running (exit code 2)" in up.output()
    assert "cannot listen on 127.0.0.1:" in up.output()
    assert not server_pids(str(config))


def test_up_killed_with_sigkill_leaves_no_party_behind(tmp_path: Path, spawn: type[Spawned]):
    config = write_cluster(tmp_path, ["alice", "bob"])
    up, pids = start_up(spawn, config, tmp_path / "logs")
    assert all(alive(pid) for pid in pids.values())
    up.process.kill()  # no chance to stop its parties: they must notice by themselves
    up.process.wait(STOP_S)
    wait_until(lambda: not any(alive(pid) for pid in pids.values()), STOP_S, "parties gone")
    assert not server_pids(str(config))
    log = (tmp_path / "logs" / "alice.log").read_text()
    assert f"party alice: process {up.process.pid} that started it is gone, stopping" in log


def _exposed_cluster(folder: Path) -> tuple[Path, str]:
    """A 2-party cluster file without TLS whose bob listens on every interface."""
    bob_port, alice = free_port(), f"127.0.0.1:{free_port()}"
    parties = [
        {"name": "alice", "endpoint": alice, "listen": alice},
        {"name": "bob", "endpoint": f"127.0.0.1:{bob_port}", "listen": f"[::]:{bob_port}"},
    ]
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump({"parties": parties}))
    return config, f"127.0.0.1:{bob_port}"


def test_serving_beyond_loopback_without_tls_needs_insecure(tmp_path: Path, spawn: type[Spawned]):
    config, endpoint = _exposed_cluster(tmp_path)
    refused = run_cli("serve", "--config", config, "--party", "bob")
    assert refused.returncode == 2
    assert (
        "mpplug: error: party bob would listen on [::]:" in refused.stderr
        and "without TLS, where any host that reaches the port could act as the driver or as "
        "any party"
        in refused.stderr
        and "pass --insecure to accept that" in refused.stderr
    ), refused.stderr
    up = run_cli("up", "--config", config, "--log-dir", tmp_path / "logs")
    assert up.returncode == 2 and "party bob would listen on [::]:" in up.stderr, up.stderr
    assert not (tmp_path / "logs").exists()  # refused before any party started
    serve = spawn("serve", "--config", config, "--party", "bob", "--insecure")
    serve.wait_for(r"party bob \(rank 1 of 2\) serving on \[::\]:")
    wait_until(lambda: health(endpoint) == "SERVING", READY_S, "bob serving")


def _open_sessions(endpoint: str, count: int) -> list[str]:
    """Open `count` sessions at the party; the status code name of each answer."""
    codes = []
    with grpc.insecure_channel(endpoint) as channel:
        stub = rpc_pb.PartyServiceStub(channel)
        for i in range(count):
            try:
                stub.OpenSession(
                    pb.OpenSessionRequest(
                        session=f"s{i}", parties=["alice"], wire_version=WIRE_VERSION
                    ),
                    timeout=10.0,
                )
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
                assert "sessions" in exc.details(), exc.details()
    return codes


def test_server_limits_come_from_the_cluster_file_and_the_command_line(
    tmp_path: Path, spawn: type[Spawned]
):
    spec = ClusterSpec.local(["alice"])
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({**spec.to_dict(), "limits": {"sessions": 1}}))
    endpoint = spec.parties[0].endpoint
    for options, expected in [
        ((), ["OK", "RESOURCE_EXHAUSTED"]),
        (("--limit", "sessions=2"), ["OK", "OK", "RESOURCE_EXHAUSTED"]),
    ]:
        serve = spawn("serve", "--config", config, "--party", "alice", *options)
        serve.wait_for(r"party alice \(rank 0 of 1\) serving on")
        assert _open_sessions(endpoint, len(expected)) == expected, options
        serve.process.send_signal(signal.SIGTERM)
        assert serve.finish() == 0, serve.output()
    bad = run_cli("serve", "--config", config, "--party", "alice", "--limit", "sessions=many")
    assert bad.returncode == 2
    assert "mpplug: error: --limit: sessions expects int, got 'many'" in bad.stderr


def test_status_of_parties_that_are_down_exits_1(tmp_path: Path):
    config = write_cluster(tmp_path, ["alice", "bob"])
    done = run_cli("status", "--config", config, "--json", "--timeout", "1")
    assert done.returncode == 1
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["party"], r["rank"], r["health"], r["sessions"]) for r in records] == [
        ("alice", 0, "UNREACHABLE", None),
        ("bob", 1, "UNREACHABLE", None),
    ]


# -- serve ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_serve_shuts_down_cleanly_on(tmp_path: Path, spawn: type[Spawned], sig: signal.Signals):
    config = write_cluster(tmp_path, ["alice", "bob"])
    endpoint = ClusterSpec.from_yaml(config).party("bob").endpoint
    serve = spawn("serve", "--config", config, "--party", "bob", "--session-idle-timeout", "30")
    ready = serve.wait_for(r"party bob \(rank 1 of 2\) serving on")
    assert ready.endswith("; idle sessions close after 30s"), ready
    wait_until(lambda: health(endpoint) == "SERVING", READY_S, "bob serving")
    serve.process.send_signal(sig)
    assert serve.finish() == 0, serve.output()
    assert f"party bob: {sig.name}, shutting down" in serve.output()
    assert "Traceback" not in serve.output()
    assert health(endpoint, timeout=0.5) == "UNAVAILABLE"


def test_serve_reports_an_address_it_cannot_bind_as_one_error_line(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "cluster.yaml"
        endpoint = f"127.0.0.1:{port}"
        bob = {"name": "bob", "endpoint": endpoint, "listen": endpoint}
        config.write_text(yaml.safe_dump({"parties": [bob, {"name": "alice", "endpoint": "x:1"}]}))
        done = run_cli("serve", "--config", config, "--party", "bob")
    assert done.returncode == 2
    ours = [line for line in done.stderr.splitlines() if "mpplug" in line]  # not gRPC's own log
    assert len(ours) == 1 and ours[0].startswith(
        f"mpplug: error: party bob: cannot listen on {endpoint}: "
    ), done.stderr
    assert "Traceback" not in done.stderr


# -- status on a party's host -----------------------------------------------------------------
def _host_with(tmp_path: Path, certs: Path, keep: list[str]) -> Path:
    """A host's folder: the cluster file with every party's tls block, but only `keep`."""
    host = tmp_path / f"host-{'-'.join(keep) or 'bare'}"
    host.mkdir()
    for name in keep:
        shutil.copy(certs / name, host / name)
    data = {"parties": []}
    for party in ClusterSpec.from_yaml(certs / "cluster.yaml").parties:
        tls = {"ca": "ca.pem", "cert": f"{party.name}.pem", "key": f"{party.name}.key"}
        data["parties"].append({"name": party.name, "endpoint": party.endpoint, "tls": tls})
    config = host / "cluster.yaml"
    config.write_text(yaml.safe_dump(data))
    return config


def test_status_runs_on_a_host_that_holds_only_its_own_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    spec = ClusterSpec.local(["alice", "bob"])
    certs = tmp_path / "certs"
    spec = with_tls(spec, write_dev_certs(spec, certs))
    (certs / "cluster.yaml").write_text(yaml.safe_dump(spec.to_dict()))
    alice = _host_with(tmp_path, certs, ["ca.pem", "alice.pem", "alice.key"])
    bare = _host_with(tmp_path, certs, ["ca.pem"])
    with in_process(spec):
        for args in [
            [],  # alice's own certificate, found on this host
            ["--cert", str(alice.parent / "alice.pem"), "--key", str(alice.parent / "alice.key")],
        ]:
            assert main(["status", "--config", str(alice), "--json", *args]) == 0
            records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            assert [(r["party"], r["health"]) for r in records] == [
                ("alice", "SERVING"),
                ("bob", "SERVING"),
            ]
        assert main(["status", "--config", str(bare)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mpplug: error: the cluster uses TLS, so status needs a client ")
        assert "pass --cert and --key" in err
        assert main(["status", "--config", str(bare), "--cert", "x.pem"]) == 2
        assert "--cert and --key go together" in capsys.readouterr().err
