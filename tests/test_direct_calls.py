"""The direct call a warm `jax.exec` PFunction takes when every argument is a JAX array or a numpy
array of the declared type (a value a party received): it skips the kernel, refuses what the
checked path refuses with the same messages, and leaves with its cache entry."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug import ArgumentMismatchError
from mpplug.kernels import KernelRuntime, invoke, jax_exec


def _two_inputs() -> Any:
    pfunc, _, _ = mp.jax_export(
        lambda x, y: x + y.sum(), np.zeros((2, 3), np.float32), np.zeros(4, np.int32)
    )
    return pfunc


X, Y = jnp.zeros((2, 3), jnp.float32), jnp.zeros(4, jnp.int32)


class Tagged(np.ndarray):
    """An array of a subclass: it goes the checked path, as anything not a plain array does."""


def test_a_warm_call_on_jax_arrays_skips_the_kernel(monkeypatch: pytest.MonkeyPatch):
    pfunc, runtime = _two_inputs(), KernelRuntime()
    invoke(pfunc, X, Y, runtime=runtime)
    assert runtime.direct_calls[pfunc.digest].n_ins == 2
    calls: list[int] = []
    real = jax_exec.run_jax_exec

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(jax_exec, "run_jax_exec", counting)
    monkeypatch.setattr(mp.kernels.REGISTRY._entries["jax.exec"], "kernel", counting)
    (out,) = invoke(pfunc, X + 1, jnp.arange(4, dtype=jnp.int32), runtime=runtime)
    np.testing.assert_array_equal(np.asarray(out), np.full((2, 3), 7.0))
    assert calls == []
    received = np.ones((2, 3), np.float32), np.arange(4, dtype=np.int32)  # off a peer's wire
    (out,) = invoke(pfunc, *received, runtime=runtime)
    np.testing.assert_array_equal(np.asarray(out), np.full((2, 3), 7.0))
    assert calls == []
    invoke(pfunc, np.ones((2, 3), np.float32).view(Tagged), Y, runtime=runtime)  # a subclass
    assert calls == [1]


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (np.ones((2, 3), ">f4"), r"argument 0: expected f32\[2,3\], got >f4\[2,3\]$"),
        (np.ones((3, 2), np.float32), r"argument 0: expected f32\[2,3\], got f32\[3,2\]$"),
        (np.ones((2, 3), np.float64), r"argument 0: expected f32\[2,3\], got f64\[2,3\]$"),
    ],
    ids=["byte-order", "shape", "dtype"],
)
def test_a_warm_call_refuses_numpy_arrays_of_another_type_as_the_checked_path_does(
    arg: np.ndarray, message: str
):
    """JAX would convert another byte order silently: the direct call takes only the
    declared type, and anything else is checked."""
    pfunc, runtime = _two_inputs(), KernelRuntime()
    invoke(pfunc, X, Y, runtime=runtime)
    with pytest.raises(ArgumentMismatchError, match=message):
        invoke(pfunc, arg, np.arange(4, dtype=np.int32), runtime=runtime)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((jnp.zeros((3, 2)), Y), r"argument 0: expected f32\[2,3\], got f32\[3,2\]$"),
        ((jnp.zeros((2, 3), jnp.int32), Y), r"argument 0: expected f32\[2,3\], got i32\[2,3\]$"),
        ((jnp.zeros((2, 3), jnp.bfloat16), Y), r"argument 0: expected f32\[2,3\], got bf16\[2,3\]"),
        ((X, Y[None]), r"argument 1: expected i32\[4\], got i32\[1,4\]$"),
        ((X,), r"expects 2 argument\(s\) \(f32\[2,3\], i32\[4\]\), got 1$"),
        ((X, Y, Y), r"expects 2 argument\(s\) \(f32\[2,3\], i32\[4\]\), got 3$"),
    ],
    ids=["shape", "dtype", "bf16", "rank", "too-few", "too-many"],
)
def test_a_warm_call_refuses_mismatched_jax_arrays_as_the_checked_path_does(
    args: tuple[Any, ...], message: str
):
    pfunc, runtime = _two_inputs(), KernelRuntime()
    invoke(pfunc, X, Y, runtime=runtime)
    with pytest.raises(ArgumentMismatchError, match=message):
        invoke(pfunc, *args, runtime=runtime)
    with jax.enable_x64(True):
        wide = jnp.zeros(4, jnp.int64)
    expected = r"argument 1: expected i32\[4\], got i64\[4\]$"
    with pytest.raises(ArgumentMismatchError, match=expected):
        invoke(pfunc, X, wide, runtime=runtime)


def test_a_warm_64_bit_call_on_jax_arrays_stays_exact():
    wide = np.array([2**40 + 1], np.int64)
    pfunc, _, _ = mp.jax_export(lambda a: a * 2, wide)
    runtime = KernelRuntime()
    (once,) = invoke(pfunc, wide, runtime=runtime)
    (twice,) = invoke(pfunc, once, runtime=runtime)
    assert twice.dtype == np.int64 and int(twice[0]) == (2**40 + 1) * 4
    assert jax.config.read("jax_enable_x64") is False


def test_direct_calls_leave_with_the_cache_entries_they_call():
    runtime = KernelRuntime(cache_size=1)
    funcs = [mp.jax_export(lambda a, k=k: a + k, np.zeros(3, np.float32))[0] for k in range(3)]
    a = jnp.zeros(3, jnp.float32)
    for _ in range(2):
        for k, pfunc in enumerate(funcs):
            for _ in range(2):  # the second call is the direct one
                (out,) = invoke(pfunc, a, runtime=runtime)
                np.testing.assert_array_equal(np.asarray(out), np.full(3, k, np.float32))
            assert list(runtime.direct_calls) == [pfunc.digest]
            assert pfunc.digest in runtime.cache(jax_exec.CACHE_NAMESPACE)
