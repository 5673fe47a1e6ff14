"""The module-check helper's side: a process that forks a child per request, which parses
StableHLO modules and writes them again (see `module_check`, its caller's side).

It runs by path (`python -P module_parser.py`), so that it imports jaxlib's MLIR bindings and
nothing of JAX or mpplug: about a tenth of a second to start, where importing JAX takes one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import sys
import time
from typing import IO, Any

from jaxlib import _jax
from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.mlir.dialects import chlo, mhlo, mpmd, sdy
from jaxlib.mlir.dialects import stablehlo as hlo

LENGTH = struct.Struct("<Q")


def pack(parts: list[bytes]) -> bytes:
    """`parts` as one frame's bytes (a module's reply inside the helper's reply to a batch)."""
    out = [LENGTH.pack(len(parts))]
    for part in parts:
        out += [LENGTH.pack(len(part)), part]
    return b"".join(out)


def unpack(data: bytes) -> list[bytes]:
    """The parts `pack` packed, or EOFError if `data` is not a whole frame."""
    parts, at = [], 0
    try:
        (count,) = LENGTH.unpack_from(data, at)
        at += LENGTH.size
        for _ in range(count):
            (size,) = LENGTH.unpack_from(data, at)
            at += LENGTH.size
            if at + size > len(data):
                raise EOFError
            parts.append(data[at : at + size])
            at += size
    except struct.error:
        raise EOFError from None
    if not parts or at != len(data):
        raise EOFError
    return parts


def write_frame(stream: IO[bytes], parts: list[bytes]) -> None:
    stream.write(LENGTH.pack(len(parts)))
    for part in parts:
        stream.write(LENGTH.pack(len(part)))
        stream.write(part)
    stream.flush()


def read_exact(stream: IO[bytes], n: int, deadline: float | None) -> bytes:
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


def read_frame(stream: IO[bytes], deadline: float | None) -> list[bytes]:
    (count,) = LENGTH.unpack(read_exact(stream, LENGTH.size, deadline))
    parts = []
    for _ in range(count):
        (size,) = LENGTH.unpack(read_exact(stream, LENGTH.size, deadline))
        parts.append(read_exact(stream, size, deadline))
    return parts


def _custom_calls(operation: Any) -> list[dict[str, Any]]:
    """Each custom call in `operation`: its target, operand and result types, and the
    `mode` attribute of its backend config (as JSON-ready dicts)."""
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
    try:
        tensor = ir.RankedTensorType(kind)
    except ValueError:  # not a ranked tensor: matches no rule, refused where checked
        return [[-1], str(kind)]
    return [[int(d) for d in tensor.shape], str(tensor.element_type)]


class _Context(ir.Context):
    """An MLIR context with JAX's dialects, made as JAX's `make_ir_context` makes one."""

    def __init__(self) -> None:
        super(ir.Context, self).__init__()  # not ir.Context's: it loads every linked dialect
        registry = ir.DialectRegistry()
        _jax_mlir_ext.register_dialects(registry)
        self.append_dialect_registry(registry)
        self.load_all_available_dialects()
        sdy.register_dialect(self)
        mpmd.register_dialect(self)
        mhlo.register_mhlo_dialect(self)
        chlo.register_dialect(self)
        hlo.register_dialect(self)
        self.enable_multithreading(False)  # a fork has none of its parent's threads


_CONTEXT: Any = None
"""The helper's MLIR context, its dialects loaded once; each fork parses in its own copy."""


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = _Context()
    return _CONTEXT


def _transcode(module: bytes, with_sdy: bool) -> list[bytes]:
    """Parse `module` and write it again: ("ok", bytecode, *custom-call targets)."""
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
        replies.append(pack(reply))
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
                        flags, *modules = read_frame(source, None)
                    except EOFError:  # the helper is done: no module comes
                        os._exit(0)
                reply = _transcode_all(modules, flags == b"sdy")
                with os.fdopen(from_child, "wb") as out:
                    write_frame(out, reply)
            finally:
                os._exit(0)
        os.close(to_child)
        os.close(from_child)

    def check(self, request: list[bytes]) -> list[bytes]:
        """The child's reply to `request` (flags, then modules); it has exited when this
        returns."""
        try:
            with os.fdopen(self.requests, "wb") as sink:
                write_frame(sink, request)
        except BrokenPipeError:  # it died before reading: its status says why
            pass
        with os.fdopen(self.replies, "rb") as replies:
            try:
                reply = read_frame(replies, None)
            except EOFError:
                reply = []
        _, status = os.waitpid(self.pid, 0)
        if not reply:
            why = (
                f"it crashed the process parsing it ({signal.Signals(os.WTERMSIG(status)).name})"
                if os.WIFSIGNALED(status)
                else f"the process parsing it exited with code {os.WEXITSTATUS(status)}"
            )
            reply = [pack([b"error", why.encode()])]
        return reply


_WARM_UP = (
    "module { func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {"
    " %0 = stablehlo.add %arg0, %arg0 : tensor<4xf32> return %0 : tensor<4xf32> } }"
)


def _warm_up() -> None:
    """Write and read back one module here, so that each fork starts with the parser's
    one-time set-up done (dialects loaded) instead of repeating it."""
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
            request = read_frame(stdin, None)
        except EOFError:
            return  # the waiting fork reads no module and exits
        write_frame(stdout, fork.check(request))


if __name__ == "__main__":
    serve()
