"""Custom-call targets at real parties and in the Simulator: JAX's linear algebra, FFT, sort
and random numbers run the same on both clusters (to the last bit, on CPU), under the default
policy; a narrowed policy refuses a program at load, naming the party, the op, the target, the
JAX function and the setting; native kernels from untrusted programs get their buffers
checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest
import yaml
from jax import lax

import mpplug as mp
from mpplug import ClusterSpec
from mpplug.core.custom_calls import (
    DEFAULT_POLICY,
    CustomCall,
    CustomCallPolicy,
    CustomCallRefused,
    check_buffers,
)
from mpplug.errors import ConfigError
from mpplug.kernels.module_check import ModuleChecker

from .clusters import in_process

rng = np.random.default_rng(11)
A = rng.normal(size=(4, 4))
SPD = A @ A.T + 4 * np.eye(4)
B = rng.normal(size=(4, 2))
TALL = rng.normal(size=(5, 3))
SIGNAL = rng.normal(size=(8,))
KEY = np.array([7, 42], np.uint32)


def linalg(spd: Any, a: Any, b: Any, tall: Any, signal: Any, key: Any) -> dict[str, Any]:
    k = jax.random.wrap_key_data(key)
    q, r = jnp.linalg.qr(tall)
    u, s, vt = jnp.linalg.svd(tall, full_matrices=False)
    w, v = jnp.linalg.eigh(spd)
    sign, logdet = jnp.linalg.slogdet(a)
    p, lower, upper = jsl.lu(a)
    values, indices = lax.top_k(signal, 3)
    return {
        "cholesky": jnp.linalg.cholesky(spd),
        "qr": (q, r),
        "svd": (u, s, vt),
        "eigh": (w, v),
        "solve": jnp.linalg.solve(a, b),
        "inv": jnp.linalg.inv(a),
        "det": jnp.linalg.det(a),
        "slogdet": (sign, logdet),
        "lstsq": jnp.linalg.lstsq(tall, tall[:, 0])[0],
        "triangular_solve": jsl.solve_triangular(jnp.linalg.cholesky(spd), b, lower=True),
        "lu": (p, lower, upper),
        "expm": jsl.expm(a * 0.1),
        "fft": jnp.fft.fft(signal),
        "rfft": jnp.fft.rfft(signal),
        "top_k": (values, indices),
        "sort": jnp.sort(signal),
        "argsort": jnp.argsort(signal),
        "normal": jax.random.normal(k, (4,), dtype=a.dtype),
        "uniform": jax.random.uniform(k, (4,), dtype=a.dtype),
        "permutation": jax.random.permutation(k, 6),
    }


ARGS = {
    "float32": [v.astype(np.float32) for v in (SPD, A, B, TALL, SIGNAL)] + [KEY],
    "float64": [SPD, A, B, TALL, SIGNAL, KEY],
}


@mp.function
def conformance(spd: Any, a: Any, b: Any, tall: Any, signal: Any, key: Any) -> Any:
    args = (spd, a, b, tall, signal, key)
    plain = mp.run_jax(linalg, *args)
    flag = mp.run_jax(lambda x: x[0, 0] > 0, spd)
    branched = mp.cond(
        flag,
        lambda *xs: mp.run_jax(linalg, *xs),
        lambda *xs: mp.run_jax(linalg, *xs),
        *args,
    )

    def body(i: Any, carried: Any) -> Any:  # every function again, inside the loop
        return mp.run_jax(lambda c, *xs: linalg(*xs), carried, *args)

    looped = mp.fori_loop(0, 2, body, plain)
    return plain, branched, looped


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_linalg_fft_sort_and_random_run_alike_on_every_cluster(make_cluster, dtype: str):
    cluster = make_cluster(1, timeout=120.0)
    values = ARGS[dtype]
    handles = [cluster.put(0, v) for v in values]
    plain, branched, looped = cluster.fetch(cluster.evaluate(conformance, *handles), party=0)
    with jax.enable_x64(dtype == "float64"):
        want = jax.jit(linalg)(*values)
    for got in (plain, branched, looped):
        assert set(got) == set(want)
        for name in want:
            for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True):
                assert np.asarray(g).dtype == np.asarray(w).dtype, name
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    factor = np.asarray(want["cholesky"])  # numpy's product: JAX's would drop float64 to f32 here
    np.testing.assert_allclose(factor @ factor.T, values[0], 1e-4)


def cholesky_program() -> mp.MPFunction:
    @mp.function
    def program(x: Any) -> Any:
        return mp.run_jax(jnp.linalg.cholesky, x)

    return program


def test_a_narrowed_simulator_refuses_at_load_naming_op_target_origin_and_setting():
    with mp.Simulator(1, custom_calls=["annotations"]) as sim:
        x = sim.put(0, SPD.astype(np.float32))
        with pytest.raises(mp.MPPlugError) as info:
            sim.evaluate(cholesky_program(), x)
    message = str(info.value)
    assert "party 0: op %" in message and "jax.exec:cholesky" in message, message
    assert "'lapack_spotrf_ffi'" in message and "jnp.linalg.cholesky" in message, message
    assert "custom_calls: [annotations, lapack_spotrf_ffi]" in message, message
    with mp.Simulator(1, custom_calls="annotations,lapack_spotrf_ffi") as sim:  # widened back
        got = sim.fetch(sim.evaluate(cholesky_program(), sim.put(0, SPD.astype(np.float32))), 0)
    np.testing.assert_allclose(got, np.linalg.cholesky(SPD), rtol=1e-5)


def test_a_party_with_a_narrowed_policy_refuses_the_program_at_load(tmp_path: Path):
    data = ClusterSpec.local(2).to_dict()
    data["parties"][1]["custom_calls"] = ["annotations"]
    spec = ClusterSpec.from_dict(data, source="test")
    assert spec.parties[1].custom_calls.entries == ("annotations",)
    assert spec.parties[0].custom_calls == DEFAULT_POLICY
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(spec.to_dict()))

    @mp.function
    def program(x: Any) -> Any:
        return mp.run_jax(jnp.linalg.cholesky, mp.p2p(0, 1, x))

    with in_process(spec), mp.Driver(config, timeout=60.0) as driver:
        x = driver.put(0, SPD.astype(np.float32))
        with pytest.raises(mp.MPPlugError) as info:
            driver.evaluate(program, x)
        message = str(info.value)
        assert "party 1" in message and "'lapack_spotrf_ffi'" in message, message
        assert "jnp.linalg.cholesky" in message, message
        # the party serves on: a program within its policy runs
        ok = driver.evaluate(mp.function(lambda v: mp.run_jax(jnp.sin, mp.p2p(0, 1, v))), x)
        np.testing.assert_allclose(driver.fetch(ok, party=1), np.sin(SPD), rtol=1e-5)


def test_policies_parse_from_cluster_files_and_refuse_bad_entries():
    assert CustomCallPolicy.parse("stable, my_ffi_kernel", "x").entries == (
        "stable",
        "my_ffi_kernel",
    )
    cpu = DEFAULT_POLICY.admitted("cpu")
    assert "lapack_dpotrf_ffi" in cpu and "Sharding" in cpu
    assert "cusolver_potrf_ffi" not in cpu and "tpu_custom_call" not in cpu
    cuda = DEFAULT_POLICY.admitted("cuda")
    assert {"cusolver_potrf_ffi", "cu_threefry2x32_ffi"} <= cuda and "lapack_spotrf_ffi" not in cuda
    assert "mosaic_gpu_v2" not in cuda  # a Pallas kernel: admitted only by name
    assert CustomCallPolicy(("annotations",)).admitted("cpu") == {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
    }
    # a module exported for several platforms holds each one's kernels: only this one's count
    both = ["cusolver_potrf_ffi", "lapack_spotrf_ffi"]
    DEFAULT_POLICY.check(both, "cpu", "x")
    DEFAULT_POLICY.check(both, "cuda", "x")
    CustomCallPolicy(("annotations", "lapack_spotrf_ffi")).check(both, "cpu", "x")
    with pytest.raises(CustomCallRefused, match="'cusolver_potrf_ffi'"):
        CustomCallPolicy(("annotations", "lapack_spotrf_ffi")).check(both, "cuda", "x")
    data = ClusterSpec.local(1).to_dict()
    for bad in ([], "", [3], ["no spaces allowed"]):
        data["parties"][0]["custom_calls"] = bad
        with pytest.raises(ConfigError, match="custom_calls"):
            ClusterSpec.from_dict(data, source="test")


def test_a_loopback_endpoint_without_listen_listens_on_that_address_only():
    spec = ClusterSpec.from_dict(
        {
            "parties": [
                {"name": "p0", "endpoint": "127.0.0.1:47011"},
                {"name": "p1", "endpoint": "[::1]:47012"},
                {"name": "p2", "endpoint": "localhost:47013"},
                {"name": "p3", "endpoint": "10.1.2.3:47014"},
            ]
        },
        source="test",
    )
    listens = [p.listen for p in spec.parties]
    assert listens == ["127.0.0.1:47011", "[::1]:47012", "localhost:47013", "[::]:47014"]


def calls_of(checker: ModuleChecker, fn: Any, *specs: jax.ShapeDtypeStruct) -> list[CustomCall]:
    """The custom calls of `fn`'s export, as a party server's module check reads them."""
    module = jax.export.export(jax.jit(fn))(*specs).mlir_module_serialized
    return list(checker.check(module, with_sdy=True).custom_calls)


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.float32)


def test_the_native_kernels_jax_emits_pass_the_buffer_check_and_smaller_buffers_do_not():
    functions = [
        (jnp.linalg.cholesky, [f32(2, 4, 4)]),
        (jnp.linalg.qr, [f32(5, 3)]),
        (lambda x: jnp.linalg.qr(x, mode="complete"), [f32(5, 3)]),
        (jnp.linalg.svd, [f32(5, 3)]),
        (lambda x: jnp.linalg.svd(x, full_matrices=False), [f32(3, 5)]),
        (lambda x: jnp.linalg.svd(x, compute_uv=False), [f32(5, 3)]),
        (jnp.linalg.eigh, [f32(4, 4)]),
        (jnp.linalg.eig, [f32(4, 4)]),
        (jnp.linalg.inv, [f32(4, 4)]),
        (jsl.lu, [f32(5, 3)]),
        (lambda a, b: jsl.solve_triangular(a, b, lower=True), [f32(4, 4), f32(4, 2)]),
        (jsl.schur, [f32(4, 4)]),
        (jsl.hessenberg, [f32(4, 4)]),
        (lax.linalg.tridiagonal, [f32(4, 4)]),
        (lax.linalg.tridiagonal_solve, [f32(4), f32(4), f32(4), f32(4, 2)]),
    ]
    seen = set()
    checker = ModuleChecker()
    try:
        calls = [call for fn, specs in functions for call in calls_of(checker, fn, *specs)]
    finally:
        checker.close()
    for call in calls:
        check_buffers(call, "test")
        seen.add(call.target)
        shrunk = ((*call.results[0][0][:-1], 1), call.results[0][1])
        smaller = CustomCall(call.target, call.operands, (shrunk, *call.results[1:]), call.mode)
        with pytest.raises(CustomCallRefused, match="write past"):
            check_buffers(smaller, "test")
    assert len(seen) >= 12, seen
    unknown = CustomCall("site_ffi_kernel", (((4,), "f32"),), (((4,), "f32"),))
    with pytest.raises(CustomCallRefused, match="cannot check"):
        check_buffers(unknown, "test")
    check_buffers(unknown, "test", vouched=["stable", "site_ffi_kernel"])  # the site's word
