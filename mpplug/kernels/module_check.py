"""A helper process that parses the StableHLO module of each new `jax.export` artifact first.

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
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from mpplug.core.custom_calls import CustomCall
from mpplug.kernels.runtime import LRUCache

CHECK_TIMEOUT_S = 120.0
"""The longest the helper may take over one request (a module, or a batch of them) before it is
killed and the request refused."""

VERDICTS = 4096
VERDICTS_BYTES = 64 << 20
"""The modules a checker remembers as passed, at most (by count, and by their bytes in all)."""

_LENGTH = struct.Struct("<Q")


class ModuleRefused(Exception):
    """The module did not parse, or crashed or hung the parser."""


@dataclass(frozen=True)
class CheckedModule:
    bytecode: bytes
    """The module as a fork of the helper wrote it again: bytes from JAX's own writer."""
    custom_calls: tuple[CustomCall, ...]
    """Its custom calls (the caller's policy decides which it compiles)."""


class ModuleChecker:
    """The helper process (started on first use, again after it dies), one request at a time,
    and the verdicts on the modules that passed."""

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
                _write_frame(process.stdin, [b"sdy" if with_sdy else b"", *modules])
                replies = [_unpack(part) for part in _read_frame(process.stdout, deadline)]
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
            env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # never touch the party's accelerator
            self._process = subprocess.Popen(
                [sys.executable, "-P", "-c", f"from {__name__} import serve; serve()"],
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


def _pack(parts: list[bytes]) -> bytes:
    """`parts` as one frame's bytes (a module's reply inside the helper's reply to a batch)."""
    out = [_LENGTH.pack(len(parts))]
    for part in parts:
        out += [_LENGTH.pack(len(part)), part]
    return b"".join(out)


def _unpack(data: bytes) -> list[bytes]:
    """The parts `_pack` packed, or EOFError if `data` is not a whole frame."""
    parts, at = [], 0
    try:
        (count,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        for _ in range(count):
            (size,) = _LENGTH.unpack_from(data, at)
            at += _LENGTH.size
            if at + size > len(data):
                raise EOFError
            parts.append(data[at : at + size])
            at += size
    except struct.error:
        raise EOFError from None
    if not parts or at != len(data):
        raise EOFError
    return parts


def _write_frame(stream: IO[bytes], parts: list[bytes]) -> None:
    stream.write(_LENGTH.pack(len(parts)))
    for part in parts:
        stream.write(_LENGTH.pack(len(part)))
        stream.write(part)
    stream.flush()


def _read_exact(stream: IO[bytes], n: int, deadline: float | None) -> bytes:
    chunks = []
    fd = stream.fileno()
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_frame(stream: IO[bytes], deadline: float | None) -> list[bytes]:
    (count,) = _LENGTH.unpack(_read_exact(stream, _LENGTH.size, deadline))
    parts = []
    for _ in range(count):
        (size,) = _LENGTH.unpack(_read_exact(stream, _LENGTH.size, deadline))
        parts.append(_read_exact(stream, size, deadline))
    return parts


def _custom_calls(operation: Any) -> list[dict[str, Any]]:
    """Each custom call in `operation`: its target, operand and result types, and the
    `mode` attribute of its backend config (as JSON-ready dicts)."""
    from jax._src.lib.mlir import ir

    found = []
    if operation.name == "stablehlo.custom_call":
        attrs = operation.attributes
        mode = None
        if "mhlo.backend_config" in attrs:
            config = attrs["mhlo.backend_config"]
            if isinstance(config, ir.DictAttr) and "mode" in config:
                mode = ir.IntegerAttr(config["mode"]).value
        found.append(
            {
                "target": ir.StringAttr(attrs["call_target_name"]).value,
                "operands": [_tensor(v.type) for v in operation.operands],
                "results": [_tensor(v.type) for v in operation.results],
                "mode": mode,
            }
        )
    for region in operation.regions:
        for block in region:
            for op in block:
                found += _custom_calls(op.operation)
    return found


def _tensor(kind: Any) -> list[Any]:
    from jax._src.lib.mlir import ir

    try:
        tensor = ir.RankedTensorType(kind)
    except ValueError:  # not a ranked tensor: matches no rule, refused where checked
        return [[-1], str(kind)]
    return [[int(d) for d in tensor.shape], str(tensor.element_type)]


_CONTEXT: Any = None
"""The helper's MLIR context, its dialects loaded once (multithreading off: a fork has none
of the parent's threads); each fork parses in its own copy of it."""


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        from jax._src.interpreters import mlir

        _CONTEXT = mlir.make_ir_context()
        _CONTEXT.enable_multithreading(False)
    return _CONTEXT


def _transcode(module: bytes, with_sdy: bool) -> list[bytes]:
    """Parse `module` and write it again: ("ok", bytecode, *custom-call targets)."""
    from jax._src.lib import _jax
    from jax._src.lib.mlir.dialects import hlo

    version = hlo.get_version_from_compatibility_requirement(
        hlo.StablehloCompatibilityRequirement.WEEK_4
    )
    with _context():
        parsed = _jax.mlir.deserialize_portable_artifact(module)
        calls = _custom_calls(parsed.operation)
        again = _jax.mlir.serialize_portable_artifact(parsed, version, with_sdy)
    return [b"ok", bytes(again), *(json.dumps(c).encode() for c in calls)]


def _transcode_all(modules: list[bytes], with_sdy: bool) -> list[bytes]:
    """Each module's reply, packed, up to the first refusal (a batch with one counts for
    nothing, so the rest are not worth parsing)."""
    replies = []
    for module in modules:
        try:
            reply = _transcode(module, with_sdy)
        except Exception as exc:
            lines = str(exc).strip().splitlines()
            why = f"{type(exc).__name__}: {lines[0] if lines else ''}"
            reply = [b"error", why.encode()]
        replies.append(_pack(reply))
        if reply[0] != b"ok":
            break
    return replies


class _Fork:
    """A process forked for one request alone (a module, or one program's modules), so that
    what one malformed module does to the heap cannot touch the next request; a crash becomes
    an ("error", why) reply. It is forked before its request arrives, so that the fork's cost
    falls between requests."""

    def __init__(self, inherited: tuple[int, ...]) -> None:
        to_child, self.requests = os.pipe()
        self.replies, from_child = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the forked child, which never returns
            try:
                for fd in (self.requests, self.replies, *inherited):  # the helper's own pipes:
                    os.close(fd)  # a helper that dies must close them, not a waiting fork
                with os.fdopen(to_child, "rb") as source:
                    try:
                        flags, *modules = _read_frame(source, None)
                    except EOFError:  # the helper is done: no module comes
                        os._exit(0)
                reply = _transcode_all(modules, flags == b"sdy")
                with os.fdopen(from_child, "wb") as out:
                    _write_frame(out, reply)
            finally:
                os._exit(0)
        os.close(to_child)
        os.close(from_child)

    def check(self, request: list[bytes]) -> list[bytes]:
        """The child's reply to `request` (flags, then modules); it has exited when this
        returns."""
        try:
            with os.fdopen(self.requests, "wb") as sink:
                _write_frame(sink, request)
        except BrokenPipeError:  # it died before reading: its status says why
            pass
        with os.fdopen(self.replies, "rb") as replies:
            try:
                reply = _read_frame(replies, None)
            except EOFError:
                reply = []
        _, status = os.waitpid(self.pid, 0)
        if not reply:
            why = (
                f"it crashed the process parsing it ({signal.Signals(os.WTERMSIG(status)).name})"
                if os.WIFSIGNALED(status)
                else f"the process parsing it exited with code {os.WEXITSTATUS(status)}"
            )
            reply = [_pack([b"error", why.encode()])]
        return reply


_WARM_UP = (
    "module { func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {"
    " %0 = stablehlo.add %arg0, %arg0 : tensor<4xf32> return %0 : tensor<4xf32> } }"
)


def _warm_up() -> None:
    """Write and read back one module here, so that each fork starts with the parser's
    one-time set-up done (dialects loaded) instead of repeating it."""
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo

    with _context():
        version = hlo.get_version_from_compatibility_requirement(
            hlo.StablehloCompatibilityRequirement.WEEK_4
        )
        module = _jax.mlir.serialize_portable_artifact(ir.Module.parse(_WARM_UP), version, True)
    _transcode(bytes(module), True)


def serve() -> None:
    """The helper: warms the parser up once, then forks a fresh process for each request
    (the next one as soon as it has answered)."""
    _warm_up()

    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(1), "wb")  # replies only: whatever else prints goes to stderr
    os.dup2(2, 1)
    while True:
        fork = _Fork(inherited=(stdin.fileno(), stdout.fileno()))
        try:
            request = _read_frame(stdin, None)
        except EOFError:
            return  # the waiting fork reads no module and exits
        _write_frame(stdout, fork.check(request))
