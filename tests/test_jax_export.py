"""`mpplug.jax_export`: a JAX function and example pytrees become one `jax.exec` PFunction.

Pins down what is an input and what is baked in, the output tree, the attrs, dtypes and digests.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug import PFunction, TensorType, TraceError
from mpplug.kernels import KernelRuntime, invoke
from mpplug.kernels.jax_exec import supported_calling_conventions

X = np.arange(6, dtype=np.float32).reshape(2, 3)
Y = np.ones((3, 4), np.float32)


def matmul_tanh(x, y):
    return jnp.tanh(x @ y) + 1


def run(pfunc: PFunction, *args: object) -> tuple[jax.Array, ...]:
    return invoke(pfunc, *args, runtime=KernelRuntime())


def test_returns_a_jax_exec_pfunction_the_inputs_and_the_output_tree():
    pfunc, in_vars, out_tree = mp.jax_export(matmul_tanh, X, Y)
    assert isinstance(pfunc, PFunction)
    assert pfunc.fn_type == "jax.exec"
    assert pfunc.fn_name == "matmul_tanh"
    assert pfunc.ins_info == (TensorType("f32", (2, 3)), TensorType("f32", (3, 4)))
    assert pfunc.outs_info == (TensorType("f32", (2, 4)),)
    assert in_vars[0] is X and in_vars[1] is Y and len(in_vars) == 2
    assert out_tree == jax.tree.structure(0)
    assert pfunc.fn_body and isinstance(pfunc.fn_body, bytes)


def test_function_names():
    assert mp.jax_export(lambda a: a, X)[0].fn_name == "lambda"

    def inner_named(a):
        return a

    assert mp.jax_export(inner_named, X)[0].fn_name == "inner_named"
    assert mp.jax_export(jnp.sin, X)[0].fn_name == "sin"


def test_attrs_record_versions_platforms_and_kept_inputs():
    pfunc, _, _ = mp.jax_export(matmul_tanh, X, Y)
    attrs = pfunc.attrs
    assert attrs["jax.version"] == jax.__version__
    assert attrs["jax.calling_convention_version"] in supported_calling_conventions()
    assert attrs["jax.platforms"] == (jax.default_backend(),)
    assert attrs["jax.kept_inputs"] == (0, 1)
    assert attrs["jax.x64"] is False


def test_array_leaves_are_inputs_in_flattening_order_and_others_are_baked_in():
    def f(pair, *, weights, bias, mode, n):
        a, b = pair
        out = a * weights["w"] + b * weights["v"] + bias
        return out * n if mode == "scale" else out

    a = np.ones(3, np.float32)
    b = np.full(3, 2.0, np.float32)
    w = np.full(3, 10.0, np.float32)
    v = np.full(3, 100.0, np.float32)
    c = np.float32(0.5)
    pfunc, in_vars, _ = mp.jax_export(
        f, (a, b), weights={"w": w, "v": v}, bias=c, mode="scale", n=3
    )
    # kwargs flatten by sorted key: bias, mode, n, weights{v, w}; strings and ints are baked.
    assert [id(v_) for v_ in in_vars] == [id(a), id(b), id(c), id(v), id(w)]
    assert pfunc.ins_info == (
        TensorType("f32", (3,)),
        TensorType("f32", (3,)),
        TensorType("f32", ()),
        TensorType("f32", (3,)),
        TensorType("f32", (3,)),
    )
    (out,) = run(pfunc, *in_vars)
    np.testing.assert_allclose(np.asarray(out), (1 * 10 + 2 * 100 + 0.5) * 3)


def test_constants_baked_in_through_kwargs_change_the_function():
    def f(x, *, scale, offset, op):
        return getattr(jnp, op)(x * scale) + offset

    p1, in1, _ = mp.jax_export(f, X, scale=2.0, offset=1, op="sin")
    p2, in2, _ = mp.jax_export(f, X, scale=3.0, offset=1, op="sin")
    p3, _, _ = mp.jax_export(f, X, scale=2.0, offset=1, op="cos")
    assert len(in1) == len(in2) == 1
    assert p1.ins_info == (TensorType("f32", (2, 3)),)
    assert len({p1.digest, p2.digest, p3.digest}) == 3
    np.testing.assert_allclose(np.asarray(run(p1, X)[0]), np.sin(X * 2) + 1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(run(p2, X)[0]), np.sin(X * 3) + 1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(run(p3, X)[0]), np.cos(X * 2) + 1, rtol=1e-6)


def test_python_scalars_and_none_are_constants_not_inputs():
    def f(x, k, nothing, flag):
        assert nothing is None
        return x + k if flag else x - k

    pfunc, in_vars, _ = mp.jax_export(f, X, 5, None, True)
    assert len(in_vars) == 1 and pfunc.ins_info == (TensorType("f32", (2, 3)),)
    np.testing.assert_array_equal(np.asarray(run(pfunc, X)[0]), X + 5)


def test_shape_dtype_structs_and_tensor_types_are_inputs():
    spec = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    ttype = TensorType("f32", (3, 4))
    pfunc, in_vars, _ = mp.jax_export(matmul_tanh, spec, ttype)
    assert in_vars == [spec, ttype]
    assert pfunc == mp.jax_export(matmul_tanh, X, Y)[0]


def test_jax_array_inputs_give_the_same_function_as_numpy_inputs():
    from_jax = mp.jax_export(matmul_tanh, jnp.asarray(X), jnp.asarray(Y))[0]
    assert from_jax == mp.jax_export(matmul_tanh, X, Y)[0]


def test_out_tree_rebuilds_nested_outputs():
    def f(x):
        return {"pair": (x, [x + 1, x * 2]), "total": x.sum(), "nested": {"z": [x.T]}}

    pfunc, _, out_tree = mp.jax_export(f, X)
    outs = run(pfunc, X)
    assert len(outs) == len(pfunc.outs_info) == out_tree.num_leaves == 5
    tree = jax.tree.unflatten(out_tree, outs)
    assert set(tree) == {"pair", "total", "nested"}
    assert isinstance(tree["pair"], tuple) and isinstance(tree["pair"][1], list)
    np.testing.assert_array_equal(np.asarray(tree["pair"][1][1]), X * 2)
    np.testing.assert_array_equal(np.asarray(tree["nested"]["z"][0]), X.T)
    assert float(tree["total"]) == X.sum()
    assert out_tree == jax.tree.structure(f(jnp.asarray(X)))


def test_unused_inputs_are_declared_kept_out_and_still_accepted():
    def f(a, unused, b):
        return a + b

    pfunc, in_vars, _ = mp.jax_export(f, X, np.zeros(7, np.int8), X)
    assert len(pfunc.ins_info) == len(in_vars) == 3
    assert pfunc.attrs["jax.kept_inputs"] == (0, 2)
    (out,) = run(pfunc, X, np.ones(7, np.int8), X)
    np.testing.assert_array_equal(np.asarray(out), 2 * X)


def test_a_function_without_inputs_exports_and_runs():
    pfunc, in_vars, _ = mp.jax_export(lambda: jnp.arange(4, dtype=jnp.int32) * 2)
    assert in_vars == [] and pfunc.ins_info == ()
    np.testing.assert_array_equal(np.asarray(run(pfunc)[0]), [0, 2, 4, 6])


def test_exporting_the_same_function_twice_gives_the_same_digest():
    first = mp.jax_export(matmul_tanh, X, Y)[0]
    second = mp.jax_export(matmul_tanh, X, Y)[0]
    assert first.digest == second.digest and first.fn_body == second.fn_body


def _export_from_elsewhere(fn, *args):
    return functools.partial(mp.jax_export, fn)(*args)[0]


def test_the_digest_does_not_depend_on_the_call_site():
    jax.jit(matmul_tanh)(X, Y)  # tracing elsewhere first must not matter either
    assert _export_from_elsewhere(matmul_tanh, X, Y).digest == (
        mp.jax_export(matmul_tanh, X, Y)[0].digest
    )


def test_different_input_types_give_different_digests():
    base = mp.jax_export(matmul_tanh, X, Y)[0]
    assert base.digest != mp.jax_export(matmul_tanh, X, Y[:, :2])[0].digest
    assert base.digest != (
        mp.jax_export(matmul_tanh, X.astype(np.float16), Y.astype(np.float16))[0].digest
    )


def test_several_platforms_go_into_one_artifact_that_runs_here():
    pfunc, _, _ = mp.jax_export(matmul_tanh, X, Y, platforms=("cpu", "cuda"))
    assert pfunc.attrs["jax.platforms"] == ("cpu", "cuda")
    (out,) = run(pfunc, X, Y)
    np.testing.assert_allclose(np.asarray(out), np.tanh(X @ Y) + 1, rtol=1e-6)
    single = mp.jax_export(matmul_tanh, X, Y, platforms=("cpu",))[0]
    assert single.digest != pfunc.digest
    assert single == mp.jax_export(matmul_tanh, X, Y)[0]  # the default is the host's backend


def test_one_platform_may_be_named_by_a_string():
    pfunc, _, _ = mp.jax_export(matmul_tanh, X, Y, platforms="cpu")
    assert pfunc.attrs["jax.platforms"] == ("cpu",)


@pytest.mark.parametrize("platforms", [(), ("tpu9",), ("cpu", "cpu"), ("cpu", "CUDA")], ids=str)
def test_unknown_empty_or_repeated_platforms_are_a_trace_error(platforms: tuple[str, ...]):
    with pytest.raises(
        TraceError,
        match=r"matmul_tanh: expected platforms to be distinct names among cpu, cuda, rocm, "
        rf"tpu, got {re.escape(repr(platforms))}",
    ):
        mp.jax_export(matmul_tanh, X, Y, platforms=platforms)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (np.int64, 2**40 + 1),
        (np.uint64, 2**63 + 5),
        (np.float64, 1.0 + 2.0**-40),
        (np.complex128, 1.0 + 2.0**-40 - 3j),
    ],
    ids=lambda v: np.dtype(v).name if isinstance(v, type) else "",
)
def test_64_bit_inputs_stay_64_bit_without_enabling_x64(dtype: type, value: object):
    assert jax.config.read("jax_enable_x64") is False
    x: np.ndarray = np.array([value, value], dtype=dtype)
    pfunc, _, _ = mp.jax_export(lambda a: (a, a + a), x)
    ttype = TensorType(dtype, (2,))
    assert pfunc.ins_info == (ttype,) and pfunc.outs_info == (ttype, ttype)
    assert pfunc.attrs["jax.x64"] is True
    same, doubled = run(pfunc, x)
    assert same.dtype == doubled.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(same), x)
    np.testing.assert_array_equal(np.asarray(doubled), x + x)
    assert jax.config.read("jax_enable_x64") is False


def test_int64_arithmetic_is_exact_beyond_32_bits():
    big = np.array([2**40 + 1, -(2**62)], np.int64)
    pfunc, _, _ = mp.jax_export(lambda a: a * 2 + 1, big)
    (out,) = run(pfunc, big)
    assert out.dtype == np.int64
    assert np.asarray(out).tolist() == [2**41 + 3, -(2**63) + 1]
    assert jax.config.read("jax_enable_x64") is False


def test_export_inside_an_enabled_x64_context_keeps_its_types():
    x = np.array([1.5], np.float32)
    with jax.enable_x64(True):
        pfunc, _, _ = mp.jax_export(lambda a: (a, jnp.asarray(2**40, jnp.int64)), x)
    assert pfunc.outs_info == (TensorType("f32", (1,)), TensorType("i64", ()))
    assert pfunc.attrs["jax.x64"] is True
    assert int(run(pfunc, x)[1]) == 2**40


def test_unsupported_input_dtypes_are_a_trace_error():
    with pytest.raises(TraceError, match=r"lambda: unsupported input: expected one of .* <U1"):
        mp.jax_export(lambda a: a, np.array(["a"]))


def test_importing_mpplug_and_exporting_changes_no_jax_global_config():
    script = textwrap.dedent(
        """
        import json
        import jax
        import numpy as np
        before = {k: repr(v) for k, v in jax.config.values.items()}
        import mpplug
        from mpplug.kernels import invoke
        x = np.array([2**40 + 1], np.int64)
        pfunc, _, _ = mpplug.jax_export(lambda a: a + 1, x)
        out = invoke(pfunc, x)[0]
        after = {k: repr(v) for k, v in jax.config.values.items()}
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        print(json.dumps({"changed": changed, "out": str(out.dtype), "value": int(out[0])}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"changed": [], "out": "int64", "value": 2**40 + 2}
