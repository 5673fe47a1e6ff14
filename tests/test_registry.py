"""The kernel registry: entry points in `mpplug.kernels` (loaded lazily) and `@mpplug.kernel`.

`jax.exec` and a small test plugin are found the way any third-party plugin is; clashes name
both sources.
"""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mpplug_testkernels
import numpy as np
import pytest

import mpplug as mp
from mpplug import MPPlugError, PFunction, TensorType, UnknownKernelError
from mpplug.errors import DuplicateKernelError
from mpplug.kernels import (
    REGISTRY,
    KernelRegistry,
    KernelRuntime,
    default_runtime,
    invoke,
    jax_exec,
    registry,
)

SCALAR = TensorType("f32", ())


def unique(prefix: str = "test.decorated") -> str:
    return f"{prefix}.{uuid.uuid4().hex}"


def write_distribution(
    root: Path, name: str, group: str, entries: dict[str, str], module: str | None = None
) -> None:
    """A minimal installed distribution: a dist-info with entry points, and maybe a module."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = [f"[{group}]"] + [f"{key} = {value}" for key, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    if module is not None:
        module_name = next(iter(entries.values())).partition(":")[0]
        (root / f"{module_name}.py").write_text(textwrap.dedent(module))


# ---------------------------------------------------------------- entry points


def test_jax_exec_is_declared_as_an_entry_point_of_the_mpplug_distribution():
    found = [ep for ep in importlib.metadata.entry_points(group="mpplug.kernels")]
    jax_eps = [ep for ep in found if ep.name == "jax.exec"]
    assert len(jax_eps) == 1
    ep = jax_eps[0]
    assert ep.value == "mpplug.kernels.jax_exec:run_jax_exec"
    assert ep.dist is not None and ep.dist.name == "mpplug"
    assert ep.load() is jax_exec.run_jax_exec
    assert REGISTRY.lookup("jax.exec") is jax_exec.run_jax_exec


def test_jax_exec_comes_from_the_entry_point_not_from_a_decorator():
    fresh = KernelRegistry()  # the same group, discovered afresh
    with pytest.raises(DuplicateKernelError) as info:
        fresh.register("jax.exec", jax_exec.run_jax_exec)
    message = str(info.value)
    assert "entry point 'mpplug.kernels.jax_exec:run_jax_exec' (mpplug 0.1.0)" in message


def test_the_test_plugin_is_found_through_its_entry_points():
    assert REGISTRY.lookup("test.fail") is mpplug_testkernels.run_fail
    assert REGISTRY.lookup("test.sleep") is mpplug_testkernels.run_sleep
    assert {"jax.exec", "test.fail", "test.sleep"} <= set(REGISTRY.fn_types())
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="mpplug.kernels")}
    assert eps["test.fail"].value == "mpplug_testkernels:run_fail"
    dist = eps["test.fail"].dist
    assert dist is not None and dist.name == "mpplug-testkernels"


def test_the_test_plugin_kernels_run_through_invoke():
    (out,) = invoke(mpplug_testkernels.sleep_pfunction(0.01), np.float32(2.5))
    assert out == np.float32(2.5)
    with pytest.raises(ValueError, match=r"^plugin says no$"):
        invoke(mpplug_testkernels.fail_pfunction("plugin says no"), np.float32(1))


def test_entry_points_are_discovered_on_first_lookup_and_loaded_on_demand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    group = unique("mpplug.kernels.test")
    module = f"lazy_kernels_{uuid.uuid4().hex}"
    write_distribution(
        tmp_path,
        "lazy-kernels",
        group,
        {"lazy.double": f"{module}:run_double", "lazy.never": f"{module}_missing:run"},
        module="""
        def run_double(pfunc, args, runtime):
            return [args[0] * 2]
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    scans: list[str] = []
    real = registry.entry_points

    def counting(**kwargs: Any) -> Any:
        scans.append(kwargs["group"])
        return real(**kwargs)

    monkeypatch.setattr(registry, "entry_points", counting)
    fresh = KernelRegistry(group=group)
    assert scans == []  # constructing scans nothing
    assert fresh.fn_types() == ["lazy.double", "lazy.never"]
    assert scans == [group]
    assert module not in sys.modules  # discovered, not yet imported
    try:
        kernel = fresh.lookup("lazy.double")
        assert module in sys.modules
        assert fresh.lookup("lazy.double") is kernel
        assert kernel(PFunction("lazy.double", "d", b"", (), ()), [3], KernelRuntime()) == [6]
        assert scans == [group]  # looked up twice, scanned once
    finally:
        sys.modules.pop(module, None)
    with pytest.raises(ModuleNotFoundError):
        fresh.lookup("lazy.never")  # a broken plugin fails only when it is used


def test_two_distributions_declaring_one_fn_type_is_an_error_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    group = unique("mpplug.kernels.test")
    write_distribution(tmp_path, "first-plugin", group, {"clash.op": "first_mod:run"})
    write_distribution(tmp_path, "second-plugin", group, {"clash.op": "second_mod:run"})
    monkeypatch.syspath_prepend(str(tmp_path))
    fresh = KernelRegistry(group=group)
    with pytest.raises(DuplicateKernelError) as info:
        fresh.lookup("clash.op")
    message = str(info.value)
    assert "fn_type 'clash.op' is registered twice" in message
    assert "entry point 'first_mod:run' (first-plugin 1.0)" in message
    assert "entry point 'second_mod:run' (second-plugin 1.0)" in message
    assert isinstance(info.value, MPPlugError) and isinstance(info.value, ValueError)


def test_a_decorator_clashing_with_an_entry_point_is_an_error_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    group = unique("mpplug.kernels.test")
    write_distribution(tmp_path, "owner-plugin", group, {"owned.op": "owner_mod:run"})
    monkeypatch.syspath_prepend(str(tmp_path))
    fresh = KernelRegistry(group=group)

    def impostor(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
        return list(args)

    with pytest.raises(DuplicateKernelError) as info:
        fresh.register("owned.op", impostor)
    message = str(info.value)
    assert "entry point 'owner_mod:run' (owner-plugin 1.0)" in message
    assert "tests.test_registry." in message and "impostor" in message


def test_the_global_decorator_cannot_take_over_a_plugin_kernel():
    with pytest.raises(DuplicateKernelError) as info:

        @mp.kernel("test.fail")
        def takeover(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
            return list(args)

    message = str(info.value)
    assert "entry point 'mpplug_testkernels:run_fail' (mpplug-testkernels 0.1)" in message
    assert "takeover" in message
    assert REGISTRY.lookup("test.fail") is mpplug_testkernels.run_fail


# ---------------------------------------------------------------- the decorator


def test_the_decorator_registers_a_kernel_that_invoke_runs():
    fn_type = unique()
    seen: list[KernelRuntime] = []

    @mp.kernel(fn_type)
    def add_rank(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
        seen.append(runtime)
        bias = pfunc.attrs["bias"]
        assert isinstance(bias, float)
        return [args[0] + np.float32(runtime.rank) + np.float32(bias)]

    assert REGISTRY.lookup(fn_type) is add_rank  # the decorator returns the function itself
    assert fn_type in REGISTRY.fn_types()
    pfunc = PFunction(fn_type, "add_rank", b"", (SCALAR,), (SCALAR,), {"bias": 0.5})
    runtime = KernelRuntime(rank=2, world_size=3)
    (out,) = invoke(pfunc, np.float32(1), runtime=runtime)
    assert out == np.float32(3.5)
    (out,) = invoke(pfunc, np.float32(1))
    assert out == np.float32(1.5)
    assert seen == [runtime, default_runtime()]


def test_registering_one_fn_type_twice_by_decorator_names_both_functions():
    fn_type = unique()

    @mp.kernel(fn_type)
    def first(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
        return []

    with pytest.raises(DuplicateKernelError) as info:

        @mp.kernel(fn_type)
        def second(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
            return []

    message = str(info.value)
    assert f"fn_type {fn_type!r} is registered twice" in message
    assert "test_registry.test_registering_one_fn_type_twice" in message
    assert ".<locals>.first" in message and ".<locals>.second" in message
    assert REGISTRY.lookup(fn_type) is first


def test_a_redefined_function_with_the_same_name_is_still_a_clash():
    fresh = KernelRegistry(group=unique("mpplug.kernels.empty"))

    def make(value: int) -> Any:
        def kernel(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
            return [value]

        return kernel

    first = make(1)
    fresh.register("a.op", first)
    fresh.register("a.op", first)  # the very same function again is harmless
    with pytest.raises(DuplicateKernelError, match="registered twice"):
        fresh.register("a.op", make(2))  # same module and qualname, different function
    assert fresh.lookup("a.op") is first


def test_an_explicit_source_is_used_in_clash_messages():
    fresh = KernelRegistry(group=unique("mpplug.kernels.empty"))
    fresh.register("a.op", lambda p, a, r: [], source="the config file")
    with pytest.raises(DuplicateKernelError, match=r"by the config file and by .*<lambda>"):
        fresh.register("a.op", lambda p, a, r: [])


# ---------------------------------------------------------------- unknown kernels


def test_an_unknown_fn_type_is_an_error_listing_what_is_registered():
    with pytest.raises(UnknownKernelError) as info:
        REGISTRY.lookup("no.such.kernel")
    message = str(info.value)
    assert message.startswith("no kernel serves fn_type 'no.such.kernel'; registered: ")
    assert "jax.exec" in message and "test.fail" in message
    with pytest.raises(UnknownKernelError, match=r"'no\.such\.kernel'"):
        invoke(PFunction("no.such.kernel", "x", b"", (), ()))
    with pytest.raises(LookupError):
        REGISTRY.lookup("no.such.kernel")


def test_an_empty_group_registers_nothing():
    fresh = KernelRegistry(group=unique("mpplug.kernels.empty"))
    assert fresh.fn_types() == []
    with pytest.raises(UnknownKernelError, match="registered: none"):
        fresh.lookup("jax.exec")
