"""The `jax.exec` kernel: a bounded per-runtime cache of loaded artifacts, and clear refusals.

Every way a body can be wrong (type, emptiness, garbage, platform, versions) is an
InvalidPFunctionError that says what is wrong, raised quickly and never by hanging.
"""

from __future__ import annotations

import dataclasses
import random
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export_api

import mpplug as mp
from mpplug import InvalidPFunctionError, PFunction, TensorType
from mpplug.kernels import KernelRuntime, invoke, jax_exec
from mpplug.kernels.registry import REGISTRY
from mpplug.kernels.runtime import DEFAULT_CACHE_SIZE, LRUCache

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)


def f(x, y):
    return jnp.tanh(x @ y) + 1


@pytest.fixture(scope="module")
def pfunc() -> PFunction:
    return mp.jax_export(f, X, X)[0]


def with_body(pfunc: PFunction, body: bytes, **attrs: Any) -> PFunction:
    """`pfunc` with another body (and attrs overridden)."""
    return PFunction(
        pfunc.fn_type,
        pfunc.fn_name,
        body,
        pfunc.ins_info,
        pfunc.outs_info,
        {**pfunc.attrs, **attrs},
    )


def refusal(pfunc: PFunction, *args: Any) -> str:
    """The InvalidPFunctionError message invoking `pfunc` gives on a fresh runtime."""
    with pytest.raises(InvalidPFunctionError) as info:
        invoke(pfunc, *(args or (X, X)), runtime=KernelRuntime())
    return str(info.value)


def count_loads(monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> list[str]:
    """Count (and optionally slow down) the kernel's loads of an artifact (each one
    deserializes or finds it read, checks and compiles it), with the persistent compile
    cache off and none compiled in this process yet."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")
    calls: list[str] = []
    real = jax_exec.load

    def counting(pfunc: PFunction, runtime: KernelRuntime, interpret: bool = False) -> Any:
        calls.append(pfunc.digest)
        time.sleep(delay)
        return real(pfunc, runtime, interpret)

    monkeypatch.setattr(jax_exec, "load", counting)
    monkeypatch.setattr(jax_exec, "_PROCESS_CACHE", LRUCache(DEFAULT_CACHE_SIZE))
    monkeypatch.setattr(jax_exec, "_PLANS", LRUCache(DEFAULT_CACHE_SIZE))
    return calls


# ---------------------------------------------------------------- the registered kernel


def test_jax_exec_is_served_by_run_jax_exec():
    assert REGISTRY.lookup("jax.exec") is jax_exec.run_jax_exec


def test_outputs_are_jax_arrays_with_the_right_values(pfunc: PFunction):
    outs = invoke(pfunc, X, X, runtime=KernelRuntime())
    assert type(outs) is tuple and len(outs) == 1
    assert isinstance(outs[0], jax.Array)
    np.testing.assert_allclose(np.asarray(outs[0]), np.tanh(X @ X) + 1, rtol=1e-6)


# ---------------------------------------------------------------- the cache


def test_a_body_is_loaded_once_per_digest_and_device(
    pfunc: PFunction, monkeypatch: pytest.MonkeyPatch
):
    calls = count_loads(monkeypatch)
    runtime = KernelRuntime()
    for _ in range(5):
        invoke(pfunc, X, X, runtime=runtime)
    invoke(PFunction.from_bytes(pfunc.to_bytes()), X, X, runtime=runtime)  # equal copy
    assert len(calls) == 1
    invoke(pfunc, X, X, runtime=KernelRuntime())  # another runtime on the same device shares it
    assert len(calls) == 1
    assert pfunc.digest in runtime.cache(jax_exec.CACHE_NAMESPACE)


def test_runtimes_on_different_devices_load_their_own(
    pfunc: PFunction, monkeypatch: pytest.MonkeyPatch
):
    calls = count_loads(monkeypatch)
    invoke(pfunc, X, X, runtime=KernelRuntime())
    invoke(pfunc, X, X, runtime=KernelRuntime(device="cpu:0"))
    assert len(calls) == 2


def test_concurrent_first_calls_on_one_runtime_load_once(
    pfunc: PFunction, monkeypatch: pytest.MonkeyPatch
):
    calls = count_loads(monkeypatch, delay=0.2)
    runtime = KernelRuntime()
    start = threading.Barrier(4)

    def call(_: int) -> np.ndarray:
        start.wait()
        return np.asarray(invoke(pfunc, X, X, runtime=runtime)[0])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, range(4)))
    assert len(calls) == 1
    for out in results:
        np.testing.assert_array_equal(out, results[0])


def test_the_cache_is_bounded_least_recently_used_first(monkeypatch: pytest.MonkeyPatch):
    calls = count_loads(monkeypatch)
    runtime = KernelRuntime(cache_size=2)
    a, b, c = (mp.jax_export(lambda x, k=k: x + k, X)[0] for k in (1, 2, 3))
    cache = runtime.cache(jax_exec.CACHE_NAMESPACE)
    invoke(a, X, runtime=runtime)
    invoke(b, X, runtime=runtime)
    invoke(a, X, runtime=runtime)  # a is now the most recent
    invoke(c, X, runtime=runtime)  # evicts b
    assert len(cache) == 2
    assert a.digest in cache and c.digest in cache and b.digest not in cache
    assert len(calls) == 3
    np.testing.assert_array_equal(np.asarray(invoke(b, X, runtime=runtime)[0]), X + 2)
    assert b.digest in cache and len(cache) == 2
    assert len(calls) == 3  # b came back from the process-wide cache, not a new load


def test_a_refused_body_is_not_cached_and_does_not_poison_the_runtime(pfunc: PFunction):
    runtime = KernelRuntime()
    bad = with_body(pfunc, b"\x00" * 64)
    for _ in range(2):
        with pytest.raises(InvalidPFunctionError):
            invoke(bad, X, X, runtime=runtime)
    assert bad.digest not in runtime.cache(jax_exec.CACHE_NAMESPACE)
    np.testing.assert_allclose(
        np.asarray(invoke(pfunc, X, X, runtime=runtime)[0]), np.tanh(X @ X) + 1, rtol=1e-6
    )


# ---------------------------------------------------------------- refusals


def test_a_wrong_fn_type_is_refused(pfunc: PFunction):
    other = PFunction("other.kind", "f", pfunc.fn_body, pfunc.ins_info, pfunc.outs_info)
    with pytest.raises(
        InvalidPFunctionError, match=r"expected fn_type 'jax\.exec', got 'other\.kind'"
    ):
        jax_exec.run_jax_exec(other, (X, X), KernelRuntime())


def test_an_empty_body_is_refused(pfunc: PFunction):
    assert "fn_body is empty" in refusal(with_body(pfunc, b""))


def test_the_message_names_the_function_and_its_digest(pfunc: PFunction):
    bad = with_body(pfunc, b"")
    assert refusal(bad).startswith(f"PFunction 'f' ({bad.digest[:12]}): ")


def _run_with_deadline(check: Callable[[], None], seconds: float = 60.0) -> None:
    """Run `check` in a thread; fail (rather than hang the suite) if it takes too long."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(check).result(timeout=seconds)


@pytest.mark.parametrize("seed", range(8))
def test_random_bytes_are_refused_quickly(pfunc: PFunction, seed: int):
    rng = random.Random(seed)
    body = rng.randbytes(rng.choice([1, 7, 64, 500, len(pfunc.fn_body), 5000]))

    def check() -> None:
        message = refusal(with_body(pfunc, body))
        assert f"fn_body ({len(body)} bytes)" in message
        assert "jax.export artifact" in message or "does not load" in message

    _run_with_deadline(check)


def test_truncated_bodies_are_refused_quickly(pfunc: PFunction):
    n = len(pfunc.fn_body)
    # The last few bytes of a flatbuffer can be alignment padding, so stop short of them.
    cuts = [1, 3, 4, 8, 16, 40, 100, n // 4, n // 3, n // 2, 2 * n // 3, 3 * n // 4, n - 16]

    def check() -> None:
        for cut in cuts:
            message = refusal(with_body(pfunc, pfunc.fn_body[:cut]))
            assert f"fn_body ({cut} bytes)" in message, (cut, message)

    _run_with_deadline(check)


@pytest.mark.parametrize("seed", range(6))
def test_bodies_with_flipped_bytes_are_refused_at_load_not_at_call(pfunc: PFunction, seed: int):
    # Flip bytes inside the embedded StableHLO module, which JAX decodes only when lowering.
    rng = random.Random(seed)
    body = bytearray(pfunc.fn_body)
    root = jax_exec._flatbuf.Exported.GetRootAsExported(body, 0)
    module = root.MlirModuleSerializedAsNumpy()
    start = module.ctypes.data - np.frombuffer(body, np.uint8).ctypes.data
    for _ in range(8):
        body[start + rng.randrange(8, len(module))] = rng.randrange(256)

    def check() -> None:
        runtime = KernelRuntime()
        try:
            (out,) = invoke(with_body(pfunc, bytes(body)), X, X, runtime=runtime)
        except InvalidPFunctionError as exc:
            assert "fn_body" in str(exc)
        else:  # a flip that still decodes is a different, valid module
            assert out.shape == (4, 4)

    _run_with_deadline(check)


def test_an_artifact_for_another_platform_is_refused():
    cuda_only = mp.jax_export(f, X, X, platforms=("cuda",))[0]
    assert cuda_only.attrs["jax.platforms"] == ("cuda",)
    message = refusal(cuda_only)
    assert "exported for platforms ['cuda'], but this party runs on 'cpu'" in message
    assert "export with platforms=(..., 'cpu')" in message


def test_an_artifact_with_an_unsupported_calling_convention_is_refused(pfunc: PFunction):
    exported = jax_export_api.deserialize(bytearray(pfunc.fn_body))
    future = dataclasses.replace(exported, calling_convention_version=99)
    body = bytes(future.serialize())
    message = refusal(with_body(pfunc, body, **{jax_exec.ATTR_CALLING_CONVENTION: 10}))
    supported = jax_exec.supported_calling_conventions()
    assert "has calling convention version 99" in message
    assert f"JAX {jax.__version__} runs versions {supported.start}..{supported.stop - 1}" in message


@pytest.mark.parametrize("version", [1, 99])
def test_attrs_declaring_an_unsupported_calling_convention_are_refused(
    pfunc: PFunction, version: int
):
    declared = with_body(pfunc, pfunc.fn_body, **{jax_exec.ATTR_CALLING_CONVENTION: version})
    message = refusal(declared)
    assert f"declares calling convention version {version}" in message
    assert "re-export it with a compatible JAX" in message


def _with_serialization_version(body: bytes, version: int) -> bytes:
    data = bytearray(body)
    root = jax_exec._flatbuf.Exported.GetRootAsExported(data, 0)
    field = root._tab.Offset(4)  # SerializationVersion, a uint16
    assert field != 0
    struct.pack_into("<H", data, root._tab.Pos + field, version)
    assert jax_exec._flatbuf.Exported.GetRootAsExported(data, 0).SerializationVersion() == version
    return bytes(data)


@pytest.mark.parametrize("version", [0, 999])
def test_a_serialization_version_this_jax_cannot_read_is_refused(pfunc: PFunction, version: int):
    message = refusal(with_body(pfunc, _with_serialization_version(pfunc.fn_body, version)))
    assert f"serialization version {version}, but JAX {jax.__version__} reads versions 1.." in (
        message
    )


def test_declared_types_that_disagree_with_the_artifact_are_refused(pfunc: PFunction):
    wrong_out = PFunction(
        "jax.exec", "f", pfunc.fn_body, pfunc.ins_info, (TensorType("f32", (4, 5)),), pfunc.attrs
    )
    message = refusal(wrong_out)
    assert "outs_info declares (f32[4,5]) but the artifact has (f32[4,4])" in message
    wrong_in = PFunction(
        "jax.exec", "f", pfunc.fn_body, (TensorType("f32", (4, 4)),) * 3, pfunc.outs_info
    )
    message = refusal(wrong_in, X, X, X)
    assert "ins_info declares (f32[4,4], f32[4,4], f32[4,4]) but the artifact has" in message


def test_an_artifact_body_under_another_name_still_runs(pfunc: PFunction):
    # fn_name and non-version attrs are descriptive; the body decides what runs.
    renamed = PFunction("jax.exec", "g", pfunc.fn_body, pfunc.ins_info, pfunc.outs_info, {})
    (out,) = invoke(renamed, X, X, runtime=KernelRuntime())
    np.testing.assert_allclose(np.asarray(out), np.tanh(X @ X) + 1, rtol=1e-6)
