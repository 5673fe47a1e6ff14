"""Party server processes on this host: one per party of a cluster file, started, waited on
until they serve, and stopped or killed. Tests, benchmarks and `mpplug up` build on it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from mpplug.config import ClusterSpec
from mpplug.errors import MPPlugError
from mpplug.remote.session import DEFAULT_IDLE_TIMEOUT
from mpplug.remote.status import query_status

log = logging.getLogger("mpplug")

LOG_TAIL_CHARS = 4000

SHARED_HOST_ENV = {"OPENBLAS_NUM_THREADS": "1"}
"""Defaults for parties that share this host's cores (this process's environment and `env`
override them): numpy's OpenBLAS runs each float product (an interpreted first run's) on a
thread per core that spin while they wait, so parties multiplying at once on two cores took
160-230 ms for a 128x128 product's round that takes 6-10 ms on one thread each."""


class LocalParties:
    """`python -m mpplug.remote.server` for each party of `config`, logging to `log_dir`.

    `env` adds to (or overrides) this process's environment, over `SHARED_HOST_ENV`, for the
    parties; `timeout`, `session_idle_timeout`, `limits` (NAME=VALUE) and `insecure` are
    passed to each party (see `mpplug serve`). With `fork` (where the OS forks), each party is
    forked from a fork server that has imported the party server already
    (`mpplug.remote.forkserver`, one per environment, kept while this process runs): it
    serves in about 0.1 s instead of 1-2 s: for many short-lived clusters (the test suite).
    By default each party is a fresh interpreter, as a deployment starts it (and as `ps`
    names it). Each party stops by itself when this process
    is gone, even killed with SIGKILL. Used as a context manager, every process is killed on
    exit, even when the body fails.
    """

    def __init__(
        self,
        config: str | Path,
        *,
        log_dir: str | Path,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        session_idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        limits: Sequence[str] = (),
        insecure: bool = False,
        fork: bool = False,
    ) -> None:
        self.config = Path(config)
        self.spec = ClusterSpec.from_yaml(self.config)
        self.log_dir = Path(log_dir)
        self.env = {**SHARED_HOST_ENV, **os.environ, **(env or {})}
        self.timeout = timeout
        self.session_idle_timeout = session_idle_timeout
        self.limits = list(limits)
        self.insecure = insecure
        self.fork = fork and hasattr(os, "fork")
        self.processes: dict[str, subprocess.Popen[bytes] | ForkedParty] = {}

    def start(self, names: Iterable[str] | None = None) -> None:
        """Launch the named parties (default: all); returns without waiting for them."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in names if names is not None else self.spec.names:
            self.spec.party(name)
            argv = ["--config", str(self.config), "--party", name, "--timeout", str(self.timeout)]
            argv += ["--session-idle-timeout", str(self.session_idle_timeout)]
            argv += [f"--limit={limit}" for limit in self.limits]
            argv += ["--insecure"] * self.insecure
            server = fork_server(self.env) if self.fork else None
            if server is not None:
                try:
                    self.processes[name] = server.start(argv, self.log_path(name), self.env)
                    continue
                except OSError as exc:  # the server is gone: a fresh interpreter then
                    log.warning("party %s: forking it failed (%s); starting it afresh", name, exc)
            command = [sys.executable, "-m", "mpplug.remote.server", *argv]
            command += ["--parent-pid", str(os.getpid())]
            with open(self.log_path(name), "ab") as log_file:
                self.processes[name] = subprocess.Popen(
                    command, stdout=log_file, stderr=subprocess.STDOUT, env=self.env
                )

    def wait_ready(self, timeout: float = 60.0, names: Iterable[str] | None = None) -> None:
        """Block until every named party reports SERVING; MPPlugError with its log if one
        exits or is still not serving after `timeout` seconds."""
        pending = list(names if names is not None else self.spec.names)
        deadline = time.monotonic() + timeout
        while pending:
            name = pending[0]
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise MPPlugError(
                    f"party {name} is not running (exit code {code}); its log:\n{self.log(name)}"
                )
            if query_status(self.spec, name, timeout=1.0).serving:
                pending.pop(0)
            elif time.monotonic() > deadline:
                raise MPPlugError(
                    f"party {name} is not serving after {timeout:g}s; its log:\n{self.log(name)}"
                )
            else:
                time.sleep(0.05)

    def alive(self) -> bool:
        return bool(self.processes) and all(p.poll() is None for p in self.processes.values())

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one party and wait for it to exit."""
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(sig)
        process.wait()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every party, then SIGKILL those still running after `grace` seconds."""
        stop_processes(self.processes.values(), grace)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log(self, name: str, tail: int = LOG_TAIL_CHARS) -> str:
        """The end of a party's log."""
        try:
            return self.log_path(name).read_text(errors="replace")[-tail:]
        except OSError:
            return "(no log)"

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.log(name)}" for name in self.processes)

    def __enter__(self) -> LocalParties:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def stop_processes(
    processes: Iterable[subprocess.Popen[bytes] | ForkedParty], grace: float
) -> None:
    """SIGTERM each process, then SIGKILL any still running `grace` seconds later."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ForkedParty:
    """A party process forked by a fork server, handled as a `subprocess.Popen`: its exit
    status comes from the server, which reaps it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"party process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


REPLY_TIMEOUT_S = 60.0
"""How long a fork server may take to fork a party before the party starts afresh."""


class ForkServer:
    """`python -m mpplug.remote.forkserver` in environment `env`, and the parties it forked.
    A reader thread takes its replies; if the server dies, its parties count as exited
    (they stop by themselves once their parent is gone)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mpplug.remote.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=dict(env),
        )
        self._requesting = threading.Lock()  # one request and its reply at a time
        self._lock = threading.Lock()
        self._started: list[dict[str, object]] = []
        self._replied = threading.Condition(self._lock)
        self._parties: dict[int, ForkedParty] = {}
        self._early: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, name="mpplug-forkserver", daemon=True).start()

    def start(self, argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> ForkedParty:
        """Fork one party running `mpplug serve argv` (OSError if the server is gone)."""
        argv = [*argv, "--parent-pid", str(self.process.pid)]
        request = {"argv": argv, "log": str(log_path), "env": dict(env), "cwd": os.getcwd()}
        with self._requesting, self._lock:
            if self._gone or self.process.stdin is None:
                raise OSError("the fork server has exited")
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            if not self._replied.wait_for(lambda: self._started or self._gone, REPLY_TIMEOUT_S):
                self._gone = True  # a late reply would answer the next request: not used again
                self.process.kill()
                raise OSError(f"the fork server did not answer within {REPLY_TIMEOUT_S:g} s")
            if not self._started:
                raise OSError("the fork server exited before it forked the party")
            reply = self._started.pop(0)
            if "started" not in reply:
                raise OSError(f"the fork server did not fork the party: {reply.get('failed')}")
            pid = int(reply["started"])  # type: ignore[call-overload]
            party = self._parties[pid] = ForkedParty(pid)
            if pid in self._early:
                party._ended(self._early.pop(pid))
            return party

    def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:
                reply = json.loads(line)
                with self._lock:
                    if "exited" in reply:
                        pid, code = int(reply["exited"]), int(reply["code"])
                        party = self._parties.pop(pid, None)
                        if party is None:
                            self._early[pid] = code
                        else:
                            party._ended(code)
                    else:
                        self._started.append(reply)
                        self._replied.notify_all()
        except (ValueError, KeyError, TypeError) as exc:  # not what the server writes
            log.warning("the fork server's reply was not understood (%s); not used again", exc)
            self.process.kill()
        with self._lock:
            self._gone = True
            self._replied.notify_all()
            for party in self._parties.values():
                party._ended(-signal.SIGKILL)  # unreported: stopped once its parent went
            self._parties.clear()

    @property
    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None


_SERVERS: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def fork_server(env: Mapping[str, str]) -> ForkServer | None:
    """This process's fork server for parties in `env` (started on first use), or None
    where one cannot start."""
    key = tuple(sorted(env.items()))
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.alive:
            try:
                server = _SERVERS[key] = ForkServer(env)
            except OSError as exc:
                log.warning("no fork server for local parties (%s): each starts afresh", exc)
                return None
        return server
