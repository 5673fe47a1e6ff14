"""A helper process that parses the StableHLO module of each new `jax.export` artifact first
(`module_parser` is its side).

MLIR's bytecode reader trusts the sizes and offsets inside the bytes it reads: a malformed
module can crash the process that parses it (SIGSEGV, heap corruption). The party parses only
a module that a fresh fork of the helper parsed and wrote again, so a bad one kills that fork.

A program's modules may be checked together, in one fork (`check_together`). Their verdicts
count only when every one of them came back unchanged: then each is a module the party would
parse itself anyway, so what one of them did to the fork's heap it would do to the party's
too, and a batch gives a module no way in that checking it alone would not. A batch with any
refusal, crash or changed module counts for nothing, and each module goes to its own fork.
Verdicts are remembered by the module's sha256, so a module is checked once per process.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from mpplug.core.custom_calls import CustomCall
from mpplug.kernels import module_parser
from mpplug.kernels.module_parser import read_frame, unpack, write_frame
from mpplug.kernels.runtime import LRUCache

CHECK_TIMEOUT_S = 120.0
"""The longest the helper may take over one request (a module, or a batch of them) before it is
killed and the request refused."""

VERDICTS = 4096
VERDICTS_BYTES = 64 << 20
"""The modules a checker remembers as passed, at most (by count, and by their bytes in all)."""


class ModuleRefused(Exception):
    """The module did not parse, or crashed or hung the parser."""


@dataclass(frozen=True)
class CheckedModule:
    bytecode: bytes
    """The module as a fork of the helper wrote it again: bytes from JAX's own writer."""
    custom_calls: tuple[CustomCall, ...]
    """Its custom calls (the caller's policy decides which it compiles)."""


class ModuleChecker:
    """The helper process (started by `start` or at the first check, again after it dies), one
    request at a time, and the verdicts on the modules that passed."""

    def __init__(self, timeout: float = CHECK_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._registered = False
        self._lock = threading.Lock()
        self._passed: LRUCache[bytes, CheckedModule] = LRUCache(
            VERDICTS, weigh=lambda c: len(c.bytecode), max_weight=VERDICTS_BYTES
        )
        self.forks = 0
        """How many requests the helper has forked a process for."""

    def start(self) -> None:
        """Start the helper now rather than at the first check (a party starting up, so that
        its first program does not wait for it)."""
        with self._lock:
            self._running()

    def check(self, module: bytes, *, with_sdy: bool) -> CheckedModule:
        """`module` as a fresh fork of the helper parsed and wrote it again. A module that
        does not come back as it went in (another writer's bytes, or a corrupt module that
        still parsed) goes round once more and must then come back unchanged, so that this
        process reads only bytes a clean parse reproduces. `with_sdy` is the caller's
        backend's `serialize_with_sdy`."""
        key = _verdict_key(module, with_sdy)
        found = self._passed.get(key)
        if found is not None:
            return found
        ((first, targets),) = self._transcode([module], with_sdy)
        if first != module:
            ((again, targets),) = self._transcode([first], with_sdy)
            if again != first:
                raise ModuleRefused("written again, it does not read back as the same module")
        checked = CheckedModule(first, targets)
        self._passed.put(key, checked)
        return checked

    def check_together(self, modules: list[bytes], *, with_sdy: bool) -> int:
        """Check in one fork those of `modules` (one program's) not checked yet, so that
        `check` finds them passed; returns how many passed so. A batch that is not passed
        whole (see the module docstring) leaves each of its modules to `check`."""
        pending = {_verdict_key(m, with_sdy): m for m in modules}
        pending = {k: m for k, m in pending.items() if self._passed.get(k) is None}
        if len(pending) < 2:  # `check` does one as cheaply
            return 0
        try:
            replies = self._transcode(list(pending.values()), with_sdy)
        except ModuleRefused:
            return 0
        if any(out != module for (out, _), module in zip(replies, pending.values(), strict=True)):
            return 0
        for key, (out, targets) in zip(pending, replies, strict=True):
            self._passed.put(key, CheckedModule(out, targets))
        return len(pending)

    def _transcode(
        self, modules: list[bytes], with_sdy: bool
    ) -> list[tuple[bytes, tuple[CustomCall, ...]]]:
        """Each of `modules` as one fork parsed and wrote it again, with its custom calls;
        ModuleRefused with the first refusal's reason."""
        with self._lock:
            process = self._running()
            assert process.stdin is not None and process.stdout is not None
            deadline = time.monotonic() + self.timeout
            self.forks += 1
            try:
                write_frame(process.stdin, [b"sdy" if with_sdy else b"", *modules])
                replies = [unpack(part) for part in read_frame(process.stdout, deadline)]
            except (OSError, EOFError, TimeoutError) as exc:
                raise ModuleRefused(self._failure(exc)) from None
        done = []
        for status, *parts in replies:
            if status != b"ok":
                raise ModuleRefused(parts[0].decode(errors="replace"))
            done.append((parts[0], tuple(_call(p) for p in parts[1:])))
        if len(done) != len(modules):
            raise ModuleRefused(f"the helper answered {len(done)} of {len(modules)} modules")
        return done

    def _running(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            if not self._registered:
                atexit.register(self.close)
                self._registered = True
            # it imports no JAX; were it to, it should never touch the party's accelerator
            env = {**os.environ, "JAX_PLATFORMS": "cpu"}
            self._process = subprocess.Popen(
                [sys.executable, "-P", module_parser.__file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                start_new_session=True,  # its process group holds the forks too
            )
        return self._process

    def _failure(self, exc: Exception) -> str:
        """Why the helper gave no answer; it is stopped, and restarted for the next module."""
        process = self._process
        assert process is not None
        self._stop()
        if isinstance(exc, TimeoutError):
            return f"parsing it took over {self.timeout:g}s"
        code = process.returncode
        if code < 0:
            return f"it crashed the process parsing it ({signal.Signals(-code).name})"
        return f"the process parsing it exited with code {code}"

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the helper and any fork it has running
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()

    def close(self) -> None:
        with self._lock:
            self._stop()


def _call(part: bytes) -> CustomCall:
    """A custom call as the helper described it (bytes from our own helper process)."""
    try:
        found = json.loads(part)
        return CustomCall(
            str(found["target"]),
            tuple((tuple(int(d) for d in s), str(t)) for s, t in found["operands"]),
            tuple((tuple(int(d) for d in s), str(t)) for s, t in found["results"]),
            None if found["mode"] is None else int(found["mode"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ModuleRefused(f"its custom calls could not be read ({exc})") from None


def _verdict_key(module: bytes, with_sdy: bool) -> bytes:
    return hashlib.sha256(module).digest() + (b"sdy" if with_sdy else b"")
