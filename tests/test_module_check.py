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

import mpplug as mp
from mpplug.kernels import KernelRuntime, invoke, jax_exec
from mpplug.kernels.module_check import ModuleChecker, ModuleRefused
from mpplug.kernels.prepare import Preparation
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


def _waiting_fork(checker: ModuleChecker) -> tuple[int, int]:
    """Start the helper (checking one module) and return its pid and the pid of the fork it
    made for the next request."""
    checker.check(_exported_module(), with_sdy=False)
    helper = checker._process
    assert helper is not None
    deadline = time.monotonic() + 30
    while not _children(helper.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    (waiting,) = _children(helper.pid)
    return helper.pid, waiting


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
    helper, waiting = _waiting_fork(checker)
    os.kill(waiting, signal.SIGKILL)
    module = _emitted_module()
    with pytest.raises(ModuleRefused, match=r"crashed the process parsing it \(SIGKILL\)"):
        checker.check(module, with_sdy=True)
    assert checker.check(module, with_sdy=True).bytecode == module
    assert checker._process is not None and checker._process.pid == helper  # served on


def test_closing_leaves_neither_the_helper_nor_its_waiting_fork(checker: ModuleChecker) -> None:
    processes = list(_waiting_fork(checker))
    checker.close()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in processes)


def test_a_module_is_checked_once_and_a_programs_modules_in_one_fork(
    checker: ModuleChecker,
) -> None:
    exported, emitted = _exported_module(), _emitted_module()
    assert checker.check_together([exported, emitted, exported], with_sdy=True) == 2
    assert checker.forks == 1
    assert checker.check(exported, with_sdy=True).bytecode == exported
    assert checker.check(emitted, with_sdy=True).bytecode == emitted
    assert checker.forks == 1  # both verdicts were kept
    assert checker.check_together([exported, emitted], with_sdy=True) == 0
    assert checker.check(exported, with_sdy=False).bytecode == exported
    assert checker.forks == 2  # a verdict holds for the writer flags it was given with


def test_a_batch_with_a_refused_module_counts_for_nothing(checker: ModuleChecker) -> None:
    """No verdict of a batch is kept unless every module in it passed: each is then
    checked alone, and the bad one is refused with its own reason."""
    module, emitted = _exported_module(), _emitted_module()
    bad = module[: len(module) // 2] + b"\xff" * 64
    assert checker.check_together([emitted, bad, module], with_sdy=True) == 0
    assert checker.forks == 1
    assert checker.check(emitted, with_sdy=True).bytecode == emitted
    assert checker.forks == 2
    with pytest.raises(ModuleRefused, match="deserialize"):
        checker.check(bad, with_sdy=True)
    assert checker.check(module, with_sdy=True).bytecode == module
    assert checker.forks == 4


def test_a_batch_whose_fork_dies_counts_for_nothing(checker: ModuleChecker) -> None:
    _, waiting = _waiting_fork(checker)
    os.kill(waiting, signal.SIGKILL)
    modules = [_exported_module(), _emitted_module()]
    assert checker.check_together(modules, with_sdy=True) == 0
    assert [checker.check(m, with_sdy=True).bytecode for m in modules] == modules
    assert checker.forks == 4


def test_a_party_readying_a_program_checks_its_modules_in_one_fork(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A party trusting no artifact readies a program's functions after one fork has
    checked all their modules; its later compiles check none again."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))  # nothing compiled on disk
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    scales = np.random.default_rng().uniform(2, 3, size=4)  # functions no test checked before
    pfuncs = [mp.jax_export(lambda v, c=float(c): v * c + 1, x)[0] for c in scales]
    runtime = KernelRuntime(untrusted_artifacts=True)
    before = jax_exec._CHECKER.forks
    Preparation(pfuncs, runtime).wait("test")
    assert jax_exec._CHECKER.forks == before + 1
    Preparation(pfuncs, runtime, "tier_up").wait("test")
    for pfunc, c in zip(pfuncs, scales, strict=True):
        got = np.asarray(invoke(pfunc, x, runtime=runtime)[0])
        np.testing.assert_allclose(got, x * np.float32(c) + 1, atol=1e-6)
    assert jax_exec._CHECKER.forks == before + 1
