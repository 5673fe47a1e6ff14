"""Party server processes on this host: one per party of a cluster file, started, waited on
until they serve, and stopped or killed. Tests, benchmarks and `mpplug up` build on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from mpplug.config import ClusterSpec
from mpplug.errors import MPPlugError
from mpplug.remote.session import DEFAULT_IDLE_TIMEOUT
from mpplug.remote.status import query_status

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
    passed to each party (see `mpplug serve`). Each party stops by itself when this process
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
    ) -> None:
        self.config = Path(config)
        self.spec = ClusterSpec.from_yaml(self.config)
        self.log_dir = Path(log_dir)
        self.env = {**SHARED_HOST_ENV, **os.environ, **(env or {})}
        self.timeout = timeout
        self.session_idle_timeout = session_idle_timeout
        self.limits = list(limits)
        self.insecure = insecure
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, names: Iterable[str] | None = None) -> None:
        """Launch the named parties (default: all); returns without waiting for them."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in names if names is not None else self.spec.names:
            self.spec.party(name)
            command = [sys.executable, "-m", "mpplug.remote.server", "--config", str(self.config)]
            command += ["--party", name, "--timeout", str(self.timeout)]
            command += ["--session-idle-timeout", str(self.session_idle_timeout)]
            command += [f"--limit={limit}" for limit in self.limits]
            command += ["--insecure"] * self.insecure + ["--parent-pid", str(os.getpid())]
            with open(self.log_path(name), "ab") as log:
                self.processes[name] = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=self.env
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


def stop_processes(processes: Iterable[subprocess.Popen[bytes]], grace: float) -> None:
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
