"""The module check helper: it writes JAX's modules (and emitted rounds) back unchanged, refuses
what does not parse with the reason, answers a fork's death as a refusal and checks on, and
leaves no process behind when closed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from mpplug.kernels.module_check import ModuleChecker, ModuleRefused
from mpplug.mpc import emit


def _exported_module() -> bytes:
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    exported = jax.export.export(jax.jit(lambda x: x * 2 + 1), platforms=("cpu",))(spec)
    return bytes(exported.mlir_module_serialized)


def _emitted_module() -> bytes:
    def body(b: emit.Builder, x: emit.Value) -> list[emit.Value]:
        return [b.op("add", [x, b.value(np.full((3,), 7, np.uint64))], x.shape, x.dtype)]

    pfunc = emit.round_function("t", [jax.ShapeDtypeStruct((3,), np.uint64)], body, ("cpu",))
    return bytes(jax.export.deserialize(bytearray(pfunc.fn_body)).mlir_module_serialized)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture
def checker() -> Iterator[ModuleChecker]:
    found = ModuleChecker(timeout=60.0)
    yield found
    found.close()


def test_modules_jax_wrote_and_emitted_rounds_come_back_unchanged(checker: ModuleChecker) -> None:
    for module in (_exported_module(), _emitted_module()):
        checked = checker.check(module, with_sdy=True)
        assert checked.bytecode == module
        assert checked.custom_calls == ()


def test_bytes_that_do_not_parse_are_refused_and_the_next_module_passes(
    checker: ModuleChecker,
) -> None:
    module = _exported_module()
    with pytest.raises(ModuleRefused, match="deserialize"):
        checker.check(module[: len(module) // 2] + b"\xff" * 64, with_sdy=True)
    assert checker.check(module, with_sdy=True).bytecode == module


def test_a_fork_that_dies_is_a_refusal_and_checking_goes_on(checker: ModuleChecker) -> None:
    """The helper forks the process for the next module before it arrives; killed, it gives
    the refusal a crash gives, and the module after it gets a fresh fork."""
    module = _exported_module()
    checker.check(module, with_sdy=True)  # starts the helper
    helper = checker._process
    assert helper is not None
    deadline = time.monotonic() + 30
    while not _children(helper.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    (waiting,) = _children(helper.pid)
    os.kill(waiting, signal.SIGKILL)
    with pytest.raises(ModuleRefused, match=r"crashed the process parsing it \(SIGKILL\)"):
        checker.check(module, with_sdy=True)
    assert checker.check(module, with_sdy=True).bytecode == module
    assert checker._process is helper  # the helper itself served on


def test_closing_leaves_neither_the_helper_nor_its_waiting_fork(checker: ModuleChecker) -> None:
    checker.check(_exported_module(), with_sdy=True)
    helper = checker._process
    assert helper is not None
    deadline = time.monotonic() + 30
    while not _children(helper.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    processes = [helper.pid, *_children(helper.pid)]
    assert len(processes) == 2
    checker.close()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in processes)
