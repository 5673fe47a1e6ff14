"""`mpplug.kernels.invoke`: exported functions run end to end, and arguments are checked first.

Covers the computations, shapes, dtypes and inputs the issue lists, and the argument errors.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpplug as mp
from mpplug import ArgumentMismatchError, DType, InvalidPFunctionError, PFunction, TensorType
from mpplug.kernels import KernelRuntime, default_runtime, invoke

RNG = np.random.default_rng(20240601)


def export_and_run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Export `fn` on `args`, invoke it on the same args, and rebuild the output tree."""
    pfunc, in_vars, out_tree = mp.jax_export(fn, *args, **kwargs)
    outs = invoke(pfunc, *in_vars, runtime=KernelRuntime())
    assert len(outs) == len(pfunc.outs_info)
    for out, ttype in zip(outs, pfunc.outs_info, strict=True):
        assert TensorType.of(out) == ttype
    return jax.tree.unflatten(out_tree, outs)


def sample(dtype: DType, shape: Sequence[int]) -> np.ndarray:
    """Deterministic values that exercise each dtype's range."""
    np_dtype = dtype.numpy
    if dtype is DType.BOOL:
        return RNG.integers(0, 2, shape).astype(bool)
    if np.issubdtype(np_dtype, np.integer):
        info = np.iinfo(np_dtype)
        return RNG.integers(info.min, info.max, shape, dtype=np_dtype, endpoint=True)
    if np.issubdtype(np_dtype, np.complexfloating):
        return (RNG.standard_normal(shape) + 1j * RNG.standard_normal(shape)).astype(np_dtype)
    return (RNG.standard_normal(shape) * 100).astype(np_dtype)


# ---------------------------------------------------------------- computations


def test_elementwise():
    x, y = sample(DType.FLOAT32, (4, 5)), sample(DType.FLOAT32, (4, 5))
    out = export_and_run(lambda a, b: jnp.sin(a) * b + 2, x, y)
    np.testing.assert_allclose(np.asarray(out), np.sin(x) * y + 2, rtol=1e-5, atol=1e-4)


def test_scalar_inputs_and_outputs():
    out = export_and_run(lambda a, b: a * b - 1, np.float32(3.0), np.float32(4.0))
    assert out.shape == () and out.dtype == np.float32 and float(out) == 11.0


def test_matrix_product():
    x, y = sample(DType.FLOAT32, (8, 16)), sample(DType.FLOAT32, (16, 3))
    out = export_and_run(jnp.matmul, x, y)
    assert out.shape == (8, 3)
    np.testing.assert_allclose(np.asarray(out), x @ y, rtol=1e-4, atol=1e-2)


def test_several_outputs():
    x, y = np.arange(6, dtype=np.int32), np.full(6, 4, np.int32)
    total, diff, prod = export_and_run(lambda a, b: (a + b, a - b, a * b), x, y)
    np.testing.assert_array_equal(np.asarray(total), x + y)
    np.testing.assert_array_equal(np.asarray(diff), x - y)
    np.testing.assert_array_equal(np.asarray(prod), x * y)


def test_nested_pytree_outputs():
    x = np.arange(4, dtype=np.float32)
    out = export_and_run(lambda a: {"b": [a, (a + 1, {"c": a * 3})], "a": a.max()}, x)
    assert out["a"] == 3
    np.testing.assert_array_equal(np.asarray(out["b"][0]), x)
    np.testing.assert_array_equal(np.asarray(out["b"][1][0]), x + 1)
    np.testing.assert_array_equal(np.asarray(out["b"][1][1]["c"]), x * 3)


def test_constants_baked_in_through_kwargs():
    x = np.arange(5, dtype=np.float32)
    out = export_and_run(lambda a, *, power, shift: a**power + shift, x, power=3, shift=-1.5)
    np.testing.assert_allclose(np.asarray(out), x**3 - 1.5)


def test_unused_inputs_are_accepted():
    x = np.arange(3, dtype=np.float32)
    pfunc, _, _ = mp.jax_export(lambda a, b, c: a * 2, x, np.zeros((2, 2), np.int64), x)
    (out,) = invoke(pfunc, x, np.ones((2, 2), np.int64), x + 1)
    np.testing.assert_array_equal(np.asarray(out), x * 2)
    with pytest.raises(ArgumentMismatchError, match="expects 3 argument"):
        invoke(pfunc, x)


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 3, 4), (2, 1, 3, 2)], ids=str)
def test_one_to_four_dimensions(shape: tuple[int, ...]):
    x = sample(DType.FLOAT32, shape)
    summed, scaled, moved = export_and_run(
        lambda a: (a.sum(axis=-1), a * 2, jnp.moveaxis(a, 0, -1)), x
    )
    np.testing.assert_allclose(np.asarray(summed), x.sum(axis=-1), rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(scaled), x * 2)
    np.testing.assert_array_equal(np.asarray(moved), np.moveaxis(x, 0, -1))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 2)], ids=str)
def test_empty_arrays(shape: tuple[int, ...]):
    x = np.zeros(shape, np.float32)
    plus, total = export_and_run(lambda a: (a + 1, a.sum()), x)
    assert plus.shape == shape and plus.dtype == np.float32
    assert float(total) == 0.0


def test_large_arrays():
    x = sample(DType.FLOAT32, (2048, 2048))
    scaled, col = export_and_run(lambda a: (a * 2 + 1, a[:, 7]), x)
    assert scaled.shape == (2048, 2048)
    np.testing.assert_array_equal(np.asarray(scaled), x * 2 + 1)
    np.testing.assert_array_equal(np.asarray(col), x[:, 7])


def test_numpy_and_jax_inputs_mix():
    x = sample(DType.FLOAT32, (3, 3))
    pfunc, _, _ = mp.jax_export(jnp.add, x, x)
    expected = x + x
    for a, b in [(x, x), (jnp.asarray(x), x), (x, jnp.asarray(x)), (jnp.asarray(x),) * 2]:
        (out,) = invoke(pfunc, a, b)
        assert isinstance(out, jax.Array)
        np.testing.assert_array_equal(np.asarray(out), expected)


def test_non_arrays_are_converted_with_numpy_before_checking():
    pfunc, _, _ = mp.jax_export(lambda a, s: a * s, np.zeros(2, np.float64), np.float64(0))
    (out,) = invoke(pfunc, [1.5, 2.5], 2.0)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(np.asarray(out), [3.0, 5.0])


# ---------------------------------------------------------------- dtypes


def _op(dtype: DType) -> Any:
    if dtype is DType.BOOL:
        return lambda a, b: (a, ~a, a & b)
    if np.issubdtype(dtype.numpy, np.complexfloating):
        return lambda a, b: (a, jnp.conj(a), a + b)
    return lambda a, b: (a, -a if np.issubdtype(dtype.numpy, np.signedinteger) else a, a + b)


def _expected(dtype: DType, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
    with np.errstate(over="ignore"):
        if dtype is DType.BOOL:
            return a, ~a, a & b
        if np.issubdtype(dtype.numpy, np.complexfloating):
            return a, np.conj(a), a + b
        negated = -a if np.issubdtype(dtype.numpy, np.signedinteger) else a
        return a, negated, (a + b).astype(dtype.numpy)


@pytest.mark.parametrize("dtype", list(DType), ids=str)
def test_every_supported_dtype_runs_exactly(dtype: DType):
    a, b = sample(dtype, (3, 4)), sample(dtype, (3, 4))
    pfunc, _, _ = mp.jax_export(_op(dtype), a, b)
    assert pfunc.ins_info == (TensorType(dtype, (3, 4)),) * 2
    assert pfunc.outs_info == (TensorType(dtype, (3, 4)),) * 3
    outs = invoke(pfunc, a, b, runtime=KernelRuntime())
    for got, want in zip(outs, _expected(dtype, a, b), strict=True):
        assert got.dtype == dtype.numpy
        np.testing.assert_array_equal(np.asarray(got), want)
    assert jax.config.read("jax_enable_x64") is False


def test_bfloat16_values_survive_unchanged():
    x = np.array([1.0, 1.0078125, -3.140625, 65280.0], dtype=ml_dtypes.bfloat16)
    out = export_and_run(lambda a: a, x)
    assert out.dtype == ml_dtypes.bfloat16
    assert np.asarray(out).tobytes() == x.tobytes()


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (np.int64, [2**40 + 1, -(2**63), 2**63 - 1]),
        (np.uint64, [2**64 - 1, 2**40 + 1, 0]),
        (np.float64, [1 + 2**-52, 1e300, -5e-324]),
        (np.complex128, [1 + 2**-52 + 1e300j, -5e-324j, 0]),
    ],
    ids=["int64", "uint64", "float64", "complex128"],
)
def test_64_bit_values_are_exact_while_x64_is_off(dtype: type, values: list[Any]):
    x: np.ndarray = np.array(values, dtype=dtype)
    pfunc, _, _ = mp.jax_export(lambda a: (a, a[::-1]), x)
    same, rev = invoke(pfunc, x, runtime=KernelRuntime())
    assert same.dtype == rev.dtype == np.dtype(dtype)
    assert np.asarray(same).tobytes() == x.tobytes()
    assert np.asarray(rev).tobytes() == x[::-1].tobytes()
    assert jax.config.read("jax_enable_x64") is False


# ---------------------------------------------------------------- argument checks


@pytest.fixture(scope="module")
def two_inputs() -> PFunction:
    def f(x, y):
        return x + y.sum()

    pfunc, _, _ = mp.jax_export(f, np.zeros((2, 3), np.float32), np.zeros(4, np.int32))
    return pfunc


def test_too_few_or_too_many_arguments(two_inputs: PFunction):
    x, y = np.zeros((2, 3), np.float32), np.zeros(4, np.int32)
    message = r"'f' expects 2 argument\(s\) \(f32\[2,3\], i32\[4\]\), got {}"
    with pytest.raises(ArgumentMismatchError, match=message.format(1)):
        invoke(two_inputs, x)
    with pytest.raises(ArgumentMismatchError, match=message.format(3)):
        invoke(two_inputs, x, y, y)
    with pytest.raises(ArgumentMismatchError, match=message.format(0)):
        invoke(two_inputs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (np.zeros((3, 2), np.float32), np.zeros(4, np.int32)),
            r"'f' argument 0: expected f32\[2,3\], got f32\[3,2\]$",
        ),
        (
            (np.zeros((2, 3), np.float64), np.zeros(4, np.int32)),
            r"'f' argument 0: expected f32\[2,3\], got f64\[2,3\]$",
        ),
        (
            (np.zeros((2, 3), np.float32), np.zeros(4, np.int64)),
            r"'f' argument 1: expected i32\[4\], got i64\[4\]$",
        ),
        (
            (np.zeros((2, 3), np.float32), jnp.zeros((1, 4), jnp.int32)),
            r"'f' argument 1: expected i32\[4\], got i32\[1,4\]$",
        ),
        (
            (np.zeros((2, 3), np.float32), np.array(["a", "b", "c", "d"])),
            r"'f' argument 1: expected i32\[4\], got <U1\[4\]$",
        ),
        (
            (np.zeros((2, 3), ">f4"), np.zeros(4, np.int32)),
            r"'f' argument 0: expected f32\[2,3\], got >f4\[2,3\]$",
        ),
        (
            (np.zeros((2, 3), np.float32), [1, 2, 3, 4]),
            r"'f' argument 1: expected i32\[4\], got i64\[4\]$",
        ),
    ],
    ids=["shape", "dtype", "second", "jax", "strings", "big-endian", "list"],
)
def test_mismatched_arguments_name_the_index_expected_and_got(
    two_inputs: PFunction, args: tuple[Any, ...], message: str
):
    with pytest.raises(ArgumentMismatchError, match=message):
        invoke(two_inputs, *args)


def test_runtime_none_uses_the_default_local_runtime():
    pfunc, _, _ = mp.jax_export(lambda a: a * 7, np.zeros(2, np.int16))
    (out,) = invoke(pfunc, np.ones(2, np.int16))
    np.testing.assert_array_equal(np.asarray(out), [7, 7])
    assert pfunc.digest in default_runtime().cache("jax.exec")
    assert default_runtime() is default_runtime()
    assert (default_runtime().rank, default_runtime().world_size) == (0, 1)


def test_invoke_returns_a_tuple_of_exactly_the_declared_outputs():
    pfunc, _, _ = mp.jax_export(lambda a: [a], np.zeros(2, np.int8))
    outs = invoke(pfunc, np.ones(2, np.int8))
    assert type(outs) is tuple and len(outs) == 1


def test_a_kernel_returning_the_wrong_number_of_outputs_is_refused():
    fn_type = f"test.decorated.{uuid.uuid4().hex}"

    @mp.kernel(fn_type)
    def two_outputs(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
        return [args[0], args[0]]

    scalar = TensorType("f32", ())
    pfunc = PFunction(fn_type, "one_out", b"", (scalar,), (scalar,))
    with pytest.raises(
        InvalidPFunctionError,
        match=rf"kernel '{fn_type}' returned 2 output\(s\) for 'one_out', which declares 1",
    ):
        invoke(pfunc, np.float32(1))


def test_constants_are_placed_on_the_device_once_with_their_bits():
    """A constant PFunction gives each of its values with its bits (uint64 and bool too), as
    JAX arrays on the party's device, the same ones at every run and at every party of the
    process that shares the device; a body of the wrong size is refused."""
    from mpplug.kernels.builtin import constant_pfunction

    values = [np.array([2**64 - 1, 3], np.uint64), np.array([[True, False]]), np.float32(1.5)]
    pfunc = constant_pfunction(*values)
    runtime = KernelRuntime()
    first, again = invoke(pfunc, runtime=runtime), invoke(pfunc, runtime=runtime)
    for got, want in zip(first, values, strict=True):
        assert isinstance(got, jax.Array) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
    assert all(a is b for a, b in zip(first, again, strict=True))
    # another party of this process on the same device reads the arrays placed for the first
    other = invoke(pfunc, runtime=KernelRuntime(1, 3))
    assert all(a is b for a, b in zip(first, other, strict=True))
    short = PFunction(pfunc.fn_type, pfunc.fn_name, pfunc.fn_body[:-1], (), pfunc.outs_info)
    with pytest.raises(InvalidPFunctionError, match="need 22 body bytes, got 21"):
        invoke(short, runtime=KernelRuntime())
