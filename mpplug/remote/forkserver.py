"""A fork server for local party processes: one process that has imported mpplug's party
server (JAX, gRPC, NumPy; no backend, no thread, no socket yet) forks each party from itself,
so a party serves within about 0.1 s where a fresh interpreter spends about 1 s importing.

    python -m mpplug.remote.forkserver

It reads requests from stdin and writes replies to stdout, one JSON object a line (nothing is
unpickled; both ends are this user's own processes):

- `{"argv": [...], "log": path, "env": {...}, "cwd": path}` forks a party that runs
  `mpplug serve` with `argv`, its stdout and stderr appended to `log`, in `env` and `cwd`;
  the reply is `{"started": pid}`, or `{"failed": why}`;
- each forked party that exits is reported as `{"exited": pid, "code": code}`, `code` as
  `subprocess.Popen.returncode` has it (minus the signal that killed it).

The server exits when its stdin closes (the process that started it is gone); its parties,
started with `--parent-pid` naming the server, then stop by themselves. Everything a party
reads at import (`PYTHONPATH`, thread counts, JAX's flags) comes from the server's own
environment: a launcher keeps one server per environment (`mpplug.remote.launch`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import sys
import traceback
from types import ModuleType
from typing import Any


def serve(requests: int, replies: int, party_server: ModuleType) -> int:
    """Fork a party of `party_server` per request line read from fd `requests`, reporting on
    fd `replies`, until `requests` closes."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    pending = b""
    while True:
        ready, _, _ = select.select([requests, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
            _report_exits(replies)
        if requests in ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                return 0
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    _reply(
                        replies,
                        _fork(line, (requests, replies, wake_read, wake_write), party_server),
                    )


def _fork(line: bytes, own_fds: tuple[int, ...], party_server: ModuleType) -> dict[str, Any]:
    try:
        request = json.loads(line)
        argv = [str(a) for a in request["argv"]]
        log_path, cwd = str(request["log"]), str(request["cwd"])
        env = {str(k): str(v) for k, v in dict(request["env"]).items()}
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return {"failed": f"bad request: {type(exc).__name__}: {exc}"}
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(log)
        return {"failed": f"fork: {exc}"}
    if pid == 0:
        os._exit(_party(party_server, argv, log, env, cwd, own_fds))
    os.close(log)
    return {"started": pid}


def _party(
    party_server: ModuleType,
    argv: list[str],
    log: int,
    env: dict[str, str],
    cwd: str,
    own_fds: tuple,
) -> int:
    """In the forked child: the party, as `python -m mpplug.remote.server` would run it."""
    gc.enable()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (null, log, *own_fds):
        if fd > 2:
            os.close(fd)
    code = 1
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        code = party_server.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream: nothing to keep
                stream.flush()
    return code


def _report_exits(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(replies: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(replies, data) :]


def main() -> int:
    replies = os.dup(1)  # a party's stray print to fd 1 would corrupt the replies
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    # what Python's gc docs advise for fork without exec: no collection leaves holes in the
    # imported objects' pages, and none in a party writes to them (each would copy the page)
    gc.disable()
    party_server = importlib.import_module("mpplug.remote.server")
    gc.freeze()
    return serve(0, replies, party_server)


if __name__ == "__main__":
    sys.exit(main())
