"""The interpreted first tier of `jax.exec`: bit for bit what XLA's executable gives, op by op
at the edges (wrap-around, shifts past the width, saturating conversions, clamped slices);
refusals of what it cannot run the same; and the tiers a party runs a program's runs on.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpplug as mp
from mpplug.frontend.jax_export import jax_export
from mpplug.kernels import interpreted, jax_exec
from mpplug.kernels.prepare import ENV_TIER_UP, ENV_TIER_UP_AFTER
from mpplug.kernels.runtime import KernelRuntime, LRUCache
from mpplug.runtime import party as party_module
from mpplug.runtime.interpreter import Interpreter
from mpplug.runtime.party import Party

RNG = np.random.default_rng(7)


@pytest.fixture
def empty_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty compile caches, on disk and in this process: nothing is compiled before the test."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))
    for name in ("_PROCESS_CACHE", "_PLANS"):
        monkeypatch.setattr(jax_exec, name, LRUCache(weigh=jax_exec._weight, max_weight=1 << 30))


def _edges(dtype: Any, n: int = 64) -> np.ndarray:
    """Random values with the dtype's extremes, 0, 1 and -1 among them."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return RNG.integers(0, 2, n).astype(bool)
    if dtype.kind == "f":
        special = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5, np.inf, -np.inf, np.nan, 1e30, -1e30]
        values = RNG.standard_normal(n) * 10.0 ** RNG.integers(-3, 12, n)
        return np.concatenate([special, values])[:n].astype(dtype)
    info = np.iinfo(dtype)
    special = [info.min, info.max, 0, 1, info.max - 1, info.min + 1]
    if info.min < 0:
        special += [-1, -2]
    values = RNG.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    return np.concatenate([np.array(special, dtype), values])[:n]


def _export(fn: Callable[..., Any], *args: np.ndarray) -> jax.export.Exported:
    with jax.enable_x64(True):
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        return jax.export.export(jax.jit(fn), platforms=("cpu",))(*specs)


def test_a_plans_weight_is_the_memory_it_holds():
    """Plans are cached within a budget of bytes, so their weight must count their steps'
    Python objects (closures, cells, slot tuples), not only their constants' arrays."""

    def chain(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
        for i in range(100):
            x = jnp.where(x > y, x * 3 + i, (y ^ x) >> 1)
        return x

    words = np.arange(8, dtype=np.uint64)
    module = _export(chain, words, words).mlir_module_serialized
    interpreted.plan_serialized(module)  # the parser's own caches are not the plans'
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        plans = [interpreted.plan_serialized(module) for _ in range(10)]
        gc.collect()
        held = (tracemalloc.get_traced_memory()[0] - before) / len(plans)
    finally:
        tracemalloc.stop()
    assert len(plans[0].steps) >= 500
    assert 0.75 * held <= plans[0].weight <= 1.5 * held, (plans[0].weight, held)


def _same_as_xla(fn: Callable[..., Any], *args: np.ndarray) -> None:
    """The plan of `fn` gives XLA's bits, run step by step and as the function it writes once
    it is hot."""
    exported = _export(fn, *args)
    plan = interpreted.plan_serialized(exported.mlir_module_serialized)
    with jax.enable_x64(True):
        want = [np.asarray(w) for w in jax.tree.leaves(exported.call(*args))]
    kept = [args[i] for i in exported.module_kept_var_idx]
    runs = [interpreted.call(plan, kept) for _ in range(interpreted.HOT_CALLS + 1)]
    assert plan._hot[1] is not None  # the last run called the function the hot plan wrote
    for got in (runs[0], runs[-1]):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert (g.dtype, g.shape) == (w.dtype, w.shape)
            bits_g = g.reshape(-1).view(np.uint8) if g.dtype.kind != "b" else g
            bits_w = w.reshape(-1).view(np.uint8) if w.dtype.kind != "b" else w
            assert np.array_equal(bits_g, bits_w), (g, w)


INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float32, np.float64]


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: np.dtype(d).name)
def test_integer_ops_wrap_divide_and_shift_as_xla(dtype: Any) -> None:
    x, y = _edges(dtype), _edges(dtype)[::-1].copy()
    bits = 8 * np.dtype(dtype).itemsize
    amounts = np.arange(64).astype(dtype) % np.asarray(bits + 6, dtype)
    if np.dtype(dtype).kind == "i":
        amounts[::7] = -amounts[::7]
    _same_as_xla(lambda a, b: (a + b, a - b, a * b, -a, ~a, a & b, a | b, a ^ b), x, y)
    _same_as_xla(lambda a, b: (lax.div(a, b), lax.rem(a, b), a // b, a % b), x, y)
    _same_as_xla(lambda a, b: (jnp.maximum(a, b), jnp.minimum(a, b), a < b, a >= b, a == b), x, y)
    _same_as_xla(
        lambda a, s: (
            lax.shift_left(a, s),
            lax.shift_right_logical(a, s),
            lax.shift_right_arithmetic(a, s),
        ),
        x,
        amounts,
    )
    _same_as_xla(
        lambda a: (lax.population_count(a), jnp.abs(a), jnp.sign(a), jnp.clip(a, -3, 100)), x
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_float_ops_and_conversions_as_xla(dtype: Any) -> None:
    x, y = _edges(dtype), _edges(dtype)[::-1].copy()
    with np.errstate(all="ignore"):
        numbers = ~np.isnan(x + y) & ~np.isnan(x - y) & ~np.isnan(x * y) & ~np.isnan(x / y)
    _same_as_xla(lambda a, b: (a + b, a - b, a * b, a / b), x[numbers], y[numbers])
    _same_as_xla(lambda a, b: a <= b, x, y)
    for fn in (lax.add, lax.sub, lax.mul, lax.div, lax.rem):  # of two NaNs, XLA keeps another
        plan = interpreted.plan_serialized(_export(fn, x, y).mlir_module_serialized)
        with pytest.raises(interpreted.NotExact, match="NaN"):
            interpreted.call(plan, [x, -np.abs(y) * np.asarray(np.nan, dtype)])
    numbers = ~np.isnan(x) & ~np.isnan(y)
    _same_as_xla(lambda a, b: (jnp.maximum(a, b), jnp.minimum(a, b)), x[numbers], y[numbers])
    _same_as_xla(
        lambda a: (
            jnp.sqrt(jnp.abs(a)),
            jnp.floor(a),
            jnp.ceil(a),
            jnp.rint(a),
            lax.round(a, lax.RoundingMethod.AWAY_FROM_ZERO),
            jnp.sign(a),
            -a,
        ),
        x,
    )
    _same_as_xla(lambda a: tuple(a.astype(t) for t in (*INTS, np.bool_, *FLOATS)), x)
    _same_as_xla(lambda a: lax.bitcast_convert_type(a, np.dtype(f"i{np.dtype(dtype).itemsize}")), x)
    for t in INTS:  # every value inside the target's range: its fast path, toward zero
        info = np.iinfo(t)
        inside = np.clip(x[np.isfinite(x)], info.min, float(info.max) * 0.999)
        inside = np.concatenate([inside, [info.min, 0.99, -0.99, info.max * 0.75]]).astype(dtype)
        inside = inside[(inside >= info.min) & (inside < float(info.max) + 1.0)]
        _same_as_xla(lambda a, t=t: a.astype(t), inside)


@pytest.mark.parametrize("dtype", [*INTS, np.bool_], ids=lambda d: np.dtype(d).name)
def test_integer_conversions_as_xla(dtype: Any) -> None:
    x = _edges(dtype)
    _same_as_xla(lambda a: tuple(a.astype(t) for t in (*INTS, np.bool_, *FLOATS)), x)


def _subnormal(dtype: Any) -> np.ndarray:
    tiny = np.finfo(dtype).tiny
    return np.array([tiny / 4, -tiny / 3, tiny / 2**20], dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_a_subnormal_float_is_never_computed_with(dtype: Any) -> None:
    """XLA's CPU code reads and writes subnormals as zeros (it gives 0 for tiny/4 * 1, and
    True for tiny/4 == 0), so a call meeting one, as an argument or as what arithmetic on
    normal floats gives, is refused and compiled; folded constants keep them, as XLA's
    compiler does, so a module holding one is compiled."""
    tiny = np.finfo(dtype).tiny
    normal = np.array([tiny, -tiny * 1.5, 1.0], dtype)
    for fn in (lambda a: a * 2, lambda a: -a, lambda a: a == 0, lambda a: a.astype(np.int32)):
        plan = interpreted.plan_serialized(_export(fn, normal).mlir_module_serialized)
        interpreted.call(plan, [normal])  # normal floats run
        with pytest.raises(interpreted.NotExact, match="subnormal"):
            interpreted.call(plan, [_subnormal(dtype)])
    narrowed = np.array([1e-40, 1.0], np.float64)  # subnormal as a float32
    makers: list[tuple[Callable[..., Any], np.ndarray]] = [
        (lambda a: a * np.asarray(0.25, dtype), normal),
        (lambda a: a / np.asarray(3, dtype), normal),
        (lambda a: a + np.asarray(-tiny * 1.25, dtype), normal),
        (lambda a: lax.rem(a, np.asarray(tiny * 2, dtype)), np.array([tiny * 2.5], dtype)),
        (lambda a: a.astype(np.float32), narrowed),
        (lambda a: lax.bitcast_convert_type(a, dtype), np.array([1, 0], f"i{normal.itemsize}")),
    ]
    for fn, arg in makers:
        plan = interpreted.plan_serialized(_export(fn, arg).mlir_module_serialized)
        with pytest.raises(interpreted.NotExact, match="subnormal"):
            interpreted.call(plan, [arg])
    kept = _export(lambda a: a + lax.mul(np.asarray(tiny, dtype), np.asarray(0.25, dtype)), normal)
    with pytest.raises(interpreted.Unsupported, match="subnormal constant"):
        interpreted.plan_serialized(kept.mlir_module_serialized)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_adding_a_constant_zero_keeps_a_negative_zero_as_xla_does(dtype: Any) -> None:
    """XLA's simplifier drops x + 0 and x - 0: -0.0 + 0.0 gives -0.0 (IEEE's sum is 0.0)."""
    x = np.array([-0.0, 0.0, -1.5, np.nan, np.inf], dtype)
    zero = np.asarray(0.0, dtype)
    _same_as_xla(lambda a: (a + zero, zero + a, a - zero, a - np.asarray(-0.0, dtype)), x)
    numbers = x[~np.isnan(x)]
    _same_as_xla(lambda a, b: (a + b, a - b, b - a), numbers, np.zeros_like(numbers))  # at run time


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_float_extremes_put_zero_above_negative_zero_and_refuse_nans(dtype: Any) -> None:
    """XLA's float maximum and minimum order +0.0 above -0.0 (numpy's give either zero),
    reductions too, whatever the order; a NaN's sign they set their own way, so a plan meeting
    a NaN there raises NotExact."""
    x = np.array([0.0, -0.0, 0.0, -0.0, 1.5, -0.0], dtype)
    y = np.array([-0.0, 0.0, 0.0, -0.0, -0.0, -2.0], dtype)
    _same_as_xla(
        lambda a, b: (
            jnp.maximum(a, b),
            jnp.minimum(a, b),
            lax.clamp(b, a, -b),
            lax.clamp(a, b, a),
        ),
        x,
        y,
    )
    signs = np.array(
        [[-0.0, 0.0, -0.0], [0.0, -0.0, -0.0], [-0.0, -0.0, -0.0], [0.0, 0.0, 3.0]], dtype
    )
    _same_as_xla(lambda a: (jnp.max(a, axis=1), jnp.min(a, axis=1), jnp.max(a), jnp.min(a)), signs)
    for fn in (lambda a, b: jnp.maximum(a, b), lambda a, b: jnp.minimum(a, b)):
        plan = interpreted.plan_serialized(_export(fn, x, y).mlir_module_serialized)
        with pytest.raises(interpreted.NotExact, match="NaN"):
            interpreted.call(plan, [x, np.where(y == 0, np.asarray(np.nan, dtype), y)])


def test_a_runtime_compiles_a_call_that_meets_a_subnormal(empty_cache: None) -> None:
    runtime = KernelRuntime()
    x = np.array([np.finfo(np.float32).tiny, 3.0], np.float32)
    pfunc = _pfunction(lambda a: (a * np.float32(0.5), a * np.float32(0.5) == 0), x)
    jax_exec.prepare_jax_exec(pfunc, runtime)
    assert runtime.cache(jax_exec.CACHE_NAMESPACE).get(pfunc.digest).interpreted
    half, is_zero = mp.invoke(pfunc, x, runtime=runtime)
    assert np.asarray(half).tolist() == [0.0, 1.5]  # XLA's: tiny / 2 flushed to zero
    assert np.asarray(is_zero).tolist() == [True, False]
    assert len(jax_exec._PROCESS_CACHE) == 1


def test_bitcasts_between_widths_as_xla() -> None:
    x = _edges(np.uint64, 12).reshape(3, 4)
    _same_as_xla(lambda a: lax.bitcast_convert_type(a, np.uint32), x)
    pairs = _edges(np.uint16, 24).reshape(3, 4, 2)
    _same_as_xla(lambda a: lax.bitcast_convert_type(a, np.uint32), pairs)


def test_total_order_comparison_as_xla() -> None:
    x, y = _edges(np.float32), _edges(np.float32)[::-1].copy()
    _same_as_xla(
        lambda a, b: (
            (lax.lt_to(a, b), lax.le_to(a, b), lax.eq_to(a, b))
            if hasattr(lax, "lt_to")
            else (a < b,)
        ),
        x,
        y,
    )


def test_structural_ops_as_xla() -> None:
    x = RNG.integers(-100, 100, (4, 6, 5)).astype(np.int32)
    start = np.array([7, -3, 2], np.int32)  # clamped into range, as XLA does
    _same_as_xla(
        lambda a, s: (
            jnp.transpose(a, (2, 0, 1)),
            a.reshape(6, 20),
            a[1:4:2, ::3, 1:],
            jnp.flip(a, (0, 2)),
            jnp.concatenate([a, a * 2], axis=1),
            jnp.broadcast_to(a[:, :1, :], (4, 6, 5)),
            lax.dynamic_slice(a, (s[0], s[1], s[2]), (2, 3, 4)),
            lax.dynamic_update_slice(a, a[:2, :2, :2] + 1, (s[0], s[1], s[2])),
            lax.pad(a, np.int32(9), ((1, -1, 1), (-2, 2, 0), (0, 0, 2))),
            lax.broadcasted_iota(np.int32, (3, 4), 1),
        ),
        x,
        start,
    )


def test_gathers_reductions_and_products_as_xla() -> None:
    table = RNG.integers(-1000, 1000, (7, 5)).astype(np.int64)
    index = np.array([0, 6, -1, 9, 3, -8], np.int32)
    _same_as_xla(
        lambda t, i: (
            jnp.take(t, i, axis=0, mode="clip"),
            jnp.take(t, i, axis=1, mode="clip"),
            t[jnp.clip(i, 0, 4), jnp.clip(i, 0, 4)],
            jnp.take_along_axis(t, jnp.clip(i[:5], 0, 6)[None, :].repeat(7, 0), axis=0),
        ),
        table,
        index,
    )
    cube = RNG.integers(0, 2**63, (2, 3, 7), dtype=np.uint64)
    for at in (index, np.array([0, 6, 2**32 - 1, 5], np.uint32)):  # whole slices at one axis
        _same_as_xla(
            lambda c, i: (
                jnp.take(c, i, axis=2, mode="clip"),
                jnp.take(c, i, axis=1, mode="clip"),
                jnp.take(c, i.reshape(2, -1), axis=0, mode="clip"),
                jnp.take(c, i[:1].reshape(()), axis=2, mode="clip"),
            ),
            cube,
            at,
        )
    ints = _edges(np.uint64, 60).reshape(3, 4, 5)
    flags = _edges(np.bool_, 60).reshape(3, 20)
    _same_as_xla(
        lambda a, f: (
            a.sum(axis=(0, 2)),
            a.max(axis=1),
            a.min(),
            jnp.bitwise_xor.reduce(a, axis=0),
            f.any(axis=1),
            f.all(axis=0),
        ),
        ints,
        flags,
    )
    a = RNG.integers(0, 2**40, (3, 4, 6), dtype=np.uint64)
    b = RNG.integers(0, 2**40, (3, 6, 2), dtype=np.uint64)
    _same_as_xla(lambda p, q: (jnp.matmul(p, q), jnp.einsum("bij,bjk->ik", p, q)), a, b)
    whole_a = RNG.integers(-(2**20), 2**20, (8, 16)).astype(np.float64)
    whole_b = RNG.integers(-(2**20), 2**20, (16, 4)).astype(np.float64)
    _same_as_xla(lambda p, q: (p @ q, p.sum(axis=1)), whole_a, whole_b)


def test_rows_of_a_vector_gathered_as_xla() -> None:
    """A gather of rows of a vector (how a round reads its small PRF views), starts before,
    inside and past the vector clamped as XLA clamps them, in signed and unsigned indices."""
    words = RNG.integers(0, 2**63, 40, dtype=np.uint64)
    dims = lax.GatherDimensionNumbers(
        offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,)
    )
    for starts in (
        np.array([[0], [7], [-5], [39], [33], [2**31 - 1]], np.int32),
        np.array([[0], [35], [2**32 - 1]], np.uint32),
    ):
        _same_as_xla(
            lambda w, s: (
                lax.gather(w, s, dims, (6,), mode=lax.GatherScatterMode.CLIP),
                lax.gather(w, s, dims, (40,), mode=lax.GatherScatterMode.CLIP),
            ),
            words,
            starts,
        )

        def sliced(w: Any, s: Any) -> tuple[Any, ...]:  # read only through one-row slices
            rows = lax.gather(w, s, dims, (6,), mode=lax.GatherScatterMode.CLIP)
            return rows[0, 1:4], rows[-1:, ::2], rows[1, :].reshape(2, 3) + 1

        def shared(w: Any, s: Any) -> tuple[Any, ...]:  # read whole too: gathered
            rows = lax.gather(w, s, dims, (5,), mode=lax.GatherScatterMode.CLIP)
            return rows[0, 1:4], rows

        _same_as_xla(sliced, words, starts)
        _same_as_xla(shared, words, starts)


def test_integer_sorts_and_vector_scatters_as_xla() -> None:
    """Stable sorts by one integer key (equal keys in their order, either direction, with
    payloads), and updates put at indices of a vector (out-of-range ones dropped)."""
    ties = RNG.integers(-3, 3, (4, 50)).astype(np.int32)
    words = _edges(np.uint64, 64).reshape(4, 16)
    _same_as_xla(
        lambda t, w: (
            jnp.argsort(t, axis=1),
            jnp.argsort(t, axis=0),
            jnp.argsort(w, axis=-1),
            jnp.sort(w, axis=0),
            jnp.argsort(t, axis=1, descending=True),
            lax.sort((t, -t, t * 3), num_keys=1),
        ),
        ties,
        words,
    )
    order = RNG.permutation(40).astype(np.int32)
    values = _edges(np.int64, 40)
    _same_as_xla(lambda i, v: jnp.zeros(40, jnp.int64).at[i].set(v), order, values)
    spilling = np.concatenate([order[:30], [-50, 40, 99]]).astype(np.int32)
    _same_as_xla(
        lambda i, v: jnp.ones(40, jnp.int64).at[i].set(v, mode="drop"), spilling, values[:33]
    )
    twice = _export(lambda i, v: jnp.zeros(40, jnp.int64).at[i].set(v), order, values)
    plan = interpreted.plan_serialized(twice.mlir_module_serialized)
    with pytest.raises(interpreted.NotExact, match="two updates to one index"):
        interpreted.call(plan, [np.zeros(40, np.int32), values])
    unstable = _export(lambda t: lax.sort(t, is_stable=False), ties)
    with pytest.raises(interpreted.Unsupported, match="unstable"):
        interpreted.plan_serialized(unstable.mlir_module_serialized)


@pytest.mark.parametrize(
    "form",
    [
        dict(window_strides=(1, 1), padding="SAME"),
        dict(window_strides=(2, 1), padding=((1, 2), (0, -1)), rhs_dilation=(1, 2)),
        dict(window_strides=(1, 2), padding=((1, 0), (2, 1)), lhs_dilation=(2, 1)),
        dict(window_strides=(1, 1), padding="SAME", feature_group_count=2),
        dict(window_strides=(1, 1), padding="VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")),
    ],
    ids=["same", "strided-dilated", "lhs-dilated", "groups", "nhwc"],
)
@pytest.mark.parametrize(
    "unfold_limit", [interpreted.UNFOLD_LIMIT_BYTES, 0], ids=["one", "per-tap"]
)
def test_convolutions_of_integral_floats_and_ring_integers_as_xla(
    form: dict[str, Any], unfold_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As one product of all the windows, or (past `UNFOLD_LIMIT_BYTES`) one per tap."""
    monkeypatch.setattr(interpreted, "UNFOLD_LIMIT_BYTES", unfold_limit)
    numbers = form.get("dimension_numbers")
    groups = form.get("feature_group_count", 1)
    x = RNG.integers(-(2**12), 2**12, (2, 4, 7, 6)).astype(np.float64)
    k = RNG.integers(-(2**12), 2**12, (6, 4 // groups, 3, 2)).astype(np.float64)
    if numbers is not None:
        x, k = x.transpose(0, 2, 3, 1).copy(), k.transpose(2, 3, 1, 0).copy()

    def conv(a: jax.Array, b: jax.Array) -> jax.Array:
        return lax.conv_general_dilated(a, b, **form)

    _same_as_xla(conv, x, k)
    _same_as_xla(conv, x.astype(np.int64), k.astype(np.int64))
    exported = _export(conv, x.astype(np.float32), k.astype(np.float32))
    plan = interpreted.plan_serialized(exported.mlir_module_serialized)
    with pytest.raises(interpreted.NotExact):
        interpreted.call(plan, [x.astype(np.float32) + 0.25, k.astype(np.float32)])


def test_float_sums_that_could_round_are_not_run() -> None:
    exported = _export(
        lambda p, q: p @ q, np.zeros((4, 8), np.float32), np.zeros((8, 3), np.float32)
    )
    plan = interpreted.plan_serialized(exported.mlir_module_serialized)
    small = RNG.integers(-100, 100, (4, 8)).astype(np.float32)
    assert np.array_equal(
        interpreted.call(plan, [small, small.T[:, :3].copy()])[0], small @ small.T[:, :3]
    )
    with pytest.raises(interpreted.NotExact, match="non-integral"):
        interpreted.call(plan, [small + 0.5, small.T[:, :3].copy()])
    with pytest.raises(interpreted.NotExact, match="may round"):
        interpreted.call(plan, [small * 2.0**20, small.T[:, :3].copy()])


def _chunk_product(width: int) -> Callable[[Any, Any], Any]:
    """Ring products as mp.mpc writes them: `width`-bit chunks of uint64 words (a mask, then
    a conversion to f64), multiplied in f64."""
    mask = np.uint64((1 << width) - 1)

    def product(a: Any, b: Any) -> Any:
        chunk_a = ((a >> np.uint64(7)) & mask).astype(jnp.float64)
        chunk_b = jnp.reshape(b & mask, (16, 3)).astype(jnp.float64)
        return chunk_a @ chunk_b

    return product


@pytest.mark.parametrize("width", [24, 26])
def test_float_sums_of_chunks_the_plan_bounds_are_run_unchecked(
    width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24-bit chunks summed 16 at a time stay below 2^52: exact whatever their values, so no
    call reads them to check. 26-bit ones could reach 2^56: each call checks its operands,
    and runs the sum only where they are small enough."""
    calls: list[int] = []
    check = interpreted._check_exact
    monkeypatch.setattr(interpreted, "_check_exact", lambda *a: calls.append(1) or check(*a))
    product = _chunk_product(width)
    plan = interpreted.plan_serialized(_export(product, A64, B64).mlir_module_serialized)
    big = (RNG.integers(0, 2**63, (5, 16), dtype=np.uint64) * np.uint64(2), B64 | (1 << 40))
    small = (RNG.integers(0, 2**26, (5, 16), dtype=np.uint64) << np.uint64(7), B64 >> 40)
    for a, b in (big, small) if width == 24 else (small,):
        _same_as_xla(product, a, b)
    assert calls == ([] if width == 24 else [1] * (interpreted.HOT_CALLS + 1))  # one a call
    if width == 26:
        with pytest.raises(interpreted.NotExact, match="may round"):
            interpreted.call(plan, list(big))


def test_a_constant_is_read_once_for_the_modules_a_context_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[tuple[int, ...]] = []
    read = interpreted._dense_value
    monkeypatch.setattr(
        interpreted, "_dense_value", lambda d, shape, t: reads.append(shape) or read(d, shape, t)
    )
    monkeypatch.setattr(interpreted._contexts, "uses", interpreted.CONTEXT_USES, raising=False)
    table = np.arange(12, dtype=np.uint64).reshape(3, 4)  # planning starts a new context
    for scale in (3, 5):
        plan = interpreted.plan_serialized(
            _export(
                lambda x, s=scale: (x & np.uint64(255)) * np.uint64(s) + table, A64[:3, :4]
            ).mlir_module_serialized
        )
        x = np.full((3, 4), 1000, np.uint64)
        assert np.array_equal(interpreted.call(plan, [x])[0], (x & 255) * scale + table)
    assert sorted(reads) == [(), (), (), (3, 4)]  # the mask and the table once, each scale


A64 = np.zeros((5, 16), np.uint64)
B64 = np.random.default_rng(7).integers(0, 2**63, (48,), dtype=np.uint64)


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (jnp.exp, "exponential"),
        (jnp.tanh, "tanh"),
        (lambda a: jnp.cumsum(a, axis=2), "reduce_window"),
        (lambda a: jnp.sort(a), "sort"),
        (lambda a: a.astype(jnp.bfloat16), "bf16"),
    ],
)
def test_what_it_cannot_run_bit_for_bit_is_refused(fn: Callable[..., Any], what: str) -> None:
    exported = _export(fn, np.ones((1, 1, 4), np.float32))
    with pytest.raises(interpreted.Unsupported, match=what):
        interpreted.plan_serialized(exported.mlir_module_serialized)


def _pfunction(fn: Callable[..., Any], *args: np.ndarray) -> mp.PFunction:
    return jax_export(fn, *args, disk=False)[0]


def test_a_runtime_runs_the_plan_first_and_the_compiled_code_after_tier_up(
    empty_cache: None,
) -> None:
    runtime = KernelRuntime()
    x = RNG.integers(0, 2**62, 100, dtype=np.uint64)
    pfunc = _pfunction(lambda a: (a * a + 3) >> 5, x)
    jax_exec.prepare_jax_exec(pfunc, runtime)
    entry = runtime.cache(jax_exec.CACHE_NAMESPACE).get(pfunc.digest)
    assert entry is not None and entry.interpreted
    first = mp.invoke(pfunc, x, runtime=runtime)[0]
    assert isinstance(first, np.ndarray)  # numpy ran it, on the host: the lone CPU device
    jax_exec.tier_up_jax_exec(pfunc, runtime)
    entry = runtime.cache(jax_exec.CACHE_NAMESPACE).get(pfunc.digest)
    assert entry is not None and not entry.interpreted
    second = mp.invoke(pfunc, x, runtime=runtime)[0]
    assert isinstance(second, jax.Array)
    assert np.array_equal(first, np.asarray(second))
    assert np.array_equal(first, (x * x + np.uint64(3)) >> np.uint64(5))


def test_a_sum_the_plan_cannot_make_exact_is_compiled_at_its_call(empty_cache: None) -> None:
    runtime = KernelRuntime()
    a = RNG.standard_normal((5, 7)).astype(np.float32)
    pfunc = _pfunction(lambda p: p @ p.T, a)
    jax_exec.prepare_jax_exec(pfunc, runtime)
    assert runtime.cache(jax_exec.CACHE_NAMESPACE).get(pfunc.digest).interpreted
    got = mp.invoke(pfunc, a, runtime=runtime)[0]
    # compiled at this call (numpy's order of sums may differ from XLA's): XLA's bits
    assert np.array_equal(np.asarray(got), np.asarray(jax.jit(lambda p: p @ p.T)(a)))
    assert len(jax_exec._PROCESS_CACHE) == 1


def test_interpretation_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jax_exec.ENV_INTERPRET, "0")
    runtime = KernelRuntime()
    x = np.arange(10, dtype=np.int32)
    pfunc = _pfunction(lambda a: a * 7 - 1, x)
    jax_exec.prepare_jax_exec(pfunc, runtime)
    assert not runtime.cache(jax_exec.CACHE_NAMESPACE).get(pfunc.digest).interpreted


def _entries(sim: mp.Simulator, digest: str | None = None) -> list[bool]:
    """Whether each jax.exec function the Simulator's parties hold (for program `digest`
    only, if given) runs interpreted."""
    found = []
    for party in sim._parties:
        cache = party.runtime.cache(jax_exec.CACHE_NAMESPACE)
        if digest is None:
            found += [entry.interpreted for entry in cache.values()]
            continue
        for pfunc in dict.fromkeys(party._loaded(digest).interpreter.functions()):
            entry = cache.get(pfunc.digest)  # None for functions of other kernels
            found += [] if entry is None else [entry.interpreted]
    return found


@mp.function
def _secure_max(a: mp.MPObject, b: mp.MPObject) -> mp.MPObject:
    sealed = mp.mpc.seal(a), mp.mpc.seal(b)
    return mp.mpc.reveal(mp.mpc.run(lambda p, q: jnp.maximum(p * q, p - 1.5), *sealed), to=0)


@mp.function
def _secure_sum(a: mp.MPObject, b: mp.MPObject) -> mp.MPObject:
    return mp.mpc.reveal(mp.mpc.run(lambda p, q: p + q, *mp.mpc.seal((a, b))), to=0)


def test_a_secure_program_runs_interpreted_first_then_compiled(
    empty_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_TIER_UP, "wait")
    x = RNG.standard_normal(50).astype(np.float32)
    y = RNG.standard_normal(50).astype(np.float32)
    want = np.maximum(x * y, x - 1.5)
    with mp.Simulator(3) as sim:
        args = sim.put(0, x), sim.put(1, y)
        first = sim.fetch(sim.evaluate(_secure_max, *args), party=0)
        states = _entries(sim)
        assert states and all(states)  # every function of the first run was interpreted
        second = sim.fetch(sim.evaluate(_secure_max, *args), party=0)
        states = _entries(sim)
        assert states and not any(states)  # compiled before the second run went on
    # each run draws fresh randomness, so the two agree to the truncation's error only
    np.testing.assert_allclose(first, want, atol=1e-3)
    np.testing.assert_allclose(second, want, atol=1e-3)


def test_compiles_go_on_in_the_background_while_later_runs_use_the_plans(
    empty_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default the second run starts the compiles and does not wait for them: held back
    here, the second and third runs go on interpreted, and a new program runs meanwhile;
    released, every function is compiled and the next run uses it."""
    monkeypatch.delenv(ENV_TIER_UP, raising=False)
    monkeypatch.setenv(ENV_TIER_UP_AFTER, "0")  # compiles start at the second run
    gate = threading.Event()
    compile_one = jax_exec.run_jax_exec.tier_up  # type: ignore[attr-defined]

    def held_back(pfunc: Any, runtime: KernelRuntime) -> None:
        assert gate.wait(60), "the test never released the compiles"
        compile_one(pfunc, runtime)

    monkeypatch.setattr(jax_exec.run_jax_exec, "tier_up", held_back)
    x = RNG.standard_normal(50).astype(np.float32)
    y = RNG.standard_normal(50).astype(np.float32)
    want = np.maximum(x * y, x - 1.5)
    with mp.Simulator(3) as sim:
        args = sim.put(0, x), sim.put(1, y)
        program = sim.compile(_secure_max, *args)
        for _ in range(3):
            got = sim.fetch(sim.evaluate(program, *args), party=0)
            np.testing.assert_allclose(got, want, atol=1e-3)
            states = _entries(sim)
            assert states and all(states)  # nothing compiled yet: every run interpreted
        # a new program readies its functions on threads the held-back compiles do not hold
        other = ThreadPoolExecutor(1).submit(lambda: sim.fetch(sim.evaluate(_secure_sum, *args), 0))
        np.testing.assert_allclose(other.result(timeout=30), x + y, atol=1e-4)
        gate.set()
        tier_ups = [party._loaded(program.digest).tier_up for party in sim._parties]
        assert sum(len(t.futures) for t in tier_ups if t is not None) == len(states)
        for tier_up in tier_ups:
            tier_up.wait("test")  # type: ignore[union-attr]
        states = _entries(sim, program.digest)
        assert states and not any(states)
        got = sim.fetch(sim.evaluate(program, *args), party=0)
    np.testing.assert_allclose(got, want, atol=1e-3)


def test_a_quick_program_is_compiled_only_once_its_runs_add_up_to_the_tier_up_time(
    empty_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_TIER_UP, raising=False)
    monkeypatch.setenv(ENV_TIER_UP_AFTER, "1000")
    x = RNG.standard_normal(50).astype(np.float32)
    y = RNG.standard_normal(50).astype(np.float32)
    with mp.Simulator(3) as sim:
        args = sim.put(0, x), sim.put(1, y)
        program = sim.compile(_secure_max, *args)
        for _ in range(4):
            sim.fetch(sim.evaluate(program, *args), party=0)
        loaded = [party._loaded(program.digest) for party in sim._parties]
        assert all(p.tier_up is None and 0 < p.interpreted_s < 1000 for p in loaded)
        monkeypatch.setenv(ENV_TIER_UP_AFTER, str(min(p.interpreted_s for p in loaded)))
        sim.fetch(sim.evaluate(program, *args), party=0)  # now hot at every party
        assert all(p.tier_up is not None for p in loaded)


def test_a_long_first_run_starts_its_compiles_while_it_runs(
    empty_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a run has taken the tier-up time, its compiles start in the background before
    it ends (held here until they have), so a long first run's later steps can run
    compiled; the program's result is the same."""
    monkeypatch.delenv(ENV_TIER_UP, raising=False)
    monkeypatch.setenv(ENV_TIER_UP_AFTER, "0")
    turned = threading.Event()
    turned_hot = Party._turned_hot

    def noting(self: Party, loaded: Any) -> None:
        turned_hot(self, loaded)
        turned.set()

    run = Interpreter.run

    def held(self: Interpreter, *args: Any, **kwargs: Any) -> Any:
        assert turned.wait(30), "no compiles started during the run"
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Party, "_turned_hot", noting)
    monkeypatch.setattr(Interpreter, "run", held)
    monkeypatch.setattr(party_module, "COMPILE_S_PER_FUNCTION", 0.0)
    x = RNG.standard_normal(50).astype(np.float32)
    y = RNG.standard_normal(50).astype(np.float32)
    with mp.Simulator(3) as sim:
        args = sim.put(0, x), sim.put(1, y)
        program = sim.compile(_secure_max, *args)
        got = sim.fetch(sim.evaluate(program, *args), party=0)
        loaded = [party._loaded(program.digest) for party in sim._parties]
        assert all(p.runs == 1 and p.tier_up is not None for p in loaded)
        for p in loaded:
            p.tier_up.wait("test")  # type: ignore[union-attr]
    np.testing.assert_allclose(got, np.maximum(x * y, x - 1.5), atol=1e-3)


def test_a_first_run_shorter_than_compiling_its_functions_does_not_start_them(
    empty_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_TIER_UP, raising=False)
    monkeypatch.setenv(ENV_TIER_UP_AFTER, "0")
    monkeypatch.setattr(party_module, "COMPILE_S_PER_FUNCTION", 1000.0)
    x = RNG.standard_normal(50).astype(np.float32)
    with mp.Simulator(3) as sim:
        args = sim.put(0, x), sim.put(1, x)
        program = sim.compile(_secure_max, *args)
        sim.fetch(sim.evaluate(program, *args), party=0)
        loaded = [party._loaded(program.digest) for party in sim._parties]
        assert all(p.runs == 1 and p.tier_up is None for p in loaded)
        sim.fetch(sim.evaluate(program, *args), party=0)  # hot between runs, as before
        assert all(p.tier_up is not None for p in loaded)


_EXITING_CHILD = """
import os, sys, time
os.cpu_count = lambda: 2  # the compile pool's size: two compiles at a time
import jax.numpy as jnp, numpy as np
import mpplug as mp
from mpplug.kernels import jax_exec

compile_one = jax_exec.run_jax_exec.tier_up
def slow(pfunc, runtime):
    print("compile", flush=True)
    time.sleep(0.5)
    compile_one(pfunc, runtime)
jax_exec.run_jax_exec.tier_up = slow

@mp.function
def secure(a, b):
    sealed = mp.mpc.seal(a), mp.mpc.seal(b)
    return mp.mpc.reveal(mp.mpc.run(lambda p, q: 1.0 / (p * p + q * q + 1.0), *sealed), to=0)

sim = mp.Simulator(3)
args = sim.put(0, np.ones(8, np.float32)), sim.put(1, np.ones(8, np.float32))
for _ in range(2):
    sim.fetch(sim.evaluate(secure, *args), party=0)
print("functions", sum(len(p.runtime.cache(jax_exec.CACHE_NAMESPACE)) for p in sim._parties))
"""


def test_a_process_exits_without_running_the_compiles_still_queued(tmp_path: Any) -> None:
    """The second run queues a compile per function at each party; a process whose main
    thread ends right after it finishes the (at most two) compiles running, if any, and starts
    no other."""
    env = {**os.environ, "MPPLUG_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop(ENV_TIER_UP, None)
    env[ENV_TIER_UP_AFTER] = "0"
    done = subprocess.run(
        [sys.executable, "-c", _EXITING_CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    functions = int(next(line for line in lines if line.startswith("functions")).split()[1])
    started = lines.count("compile")
    assert functions >= 30  # the reciprocal's rounds, at three parties
    assert started <= functions // 3, (started, functions)  # without the skip: all of them


def _random_inputs(types: Any) -> list[np.ndarray]:
    inputs = []
    for t in types:
        dtype = np.dtype(t.dtype.numpy)
        if dtype.kind == "b":
            inputs.append(RNG.integers(0, 2, t.shape).astype(bool))
        elif dtype.kind == "f":
            inputs.append(RNG.standard_normal(t.shape).astype(dtype))
        elif t.shape == ():  # offsets and counters: small, as the protocol passes them
            inputs.append(np.asarray(RNG.integers(0, 3), dtype))
        else:
            info = np.iinfo(dtype)
            inputs.append(RNG.integers(info.min, info.max, t.shape, dtype=dtype, endpoint=True))
    return inputs


@pytest.mark.slow
def test_a_secure_programs_functions_interpreted_give_xlas_bits() -> None:
    """Every round function of a secure program (products, truncations, comparisons, a
    division, a gather at secret indices), on random shares, bit for bit as compiled."""
    from mpplug.runtime.interpreter import Interpreter

    def model(a: jax.Array, b: jax.Array, i: jax.Array) -> Any:
        return (a @ b.T) / (1.0 + jnp.abs(a[:, :3].sum())), jnp.sort(a[0]), a[i.astype(jnp.int32)]

    a = RNG.standard_normal((4, 6)).astype(np.float32)
    b = RNG.standard_normal((3, 6)).astype(np.float32)
    i = np.array([3, 0, 2], np.float32)

    @mp.function
    def secure(p: mp.MPObject, q: mp.MPObject, r: mp.MPObject) -> Any:
        out = mp.mpc.run(model, mp.mpc.seal(p), mp.mpc.seal(q), mp.mpc.seal(r))
        return mp.mpc.reveal(out, to=0)

    with mp.Simulator(3) as sim:
        program = sim.compile(secure, sim.put(0, a), sim.put(1, b), sim.put(2, i))
    functions = {
        pfunc.digest: pfunc
        for rank in range(3)
        for pfunc in Interpreter(program.graph, rank).functions()
        if pfunc.fn_type == "jax.exec"
    }
    every = max(1, len(functions) // 40)  # 40 of them, spread over the program: each compiles
    checked = 0
    for pfunc in list(functions.values())[::every]:
        exported = jax.export.deserialize(bytearray(pfunc.fn_body))
        try:
            plan = interpreted.plan_serialized(exported.mlir_module_serialized)
        except interpreted.Unsupported:
            continue
        args = _random_inputs(pfunc.ins_info)
        with jax.enable_x64(True):
            want = [np.asarray(w) for w in jax.tree.leaves(exported.call(*args))]
        got = interpreted.call(plan, [args[k] for k in exported.module_kept_var_idx])
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, pfunc.fn_name
            assert np.array_equal(g, w, equal_nan=True), pfunc.fn_name
        checked += 1
    assert checked >= 30


def test_a_simulator_runs_the_plans_it_made_as_it_wrote_the_rounds(
    empty_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Simulator's trace plans each round as it writes it (from the module it parsed, not
    from the artifact), those plans give XLA's bits, and its parties run them: no round is
    planned again from its artifact. A function written for other parties is not planned."""
    from mpplug.mpc import emit

    monkeypatch.setattr(emit, "_WRITTEN", LRUCache())  # none written by earlier tests
    monkeypatch.setattr(jax_exec, "_WRITTEN_PLANS", LRUCache())
    from_artifact: list[bytes] = []
    plan_serialized = interpreted.plan_serialized
    monkeypatch.setattr(
        interpreted, "plan_serialized", lambda m: from_artifact.append(m) or plan_serialized(m)
    )
    a = RNG.standard_normal((5, 4)).astype(np.float32)
    b = RNG.standard_normal((4, 3)).astype(np.float32)

    @mp.function
    def secure(p: mp.MPObject, q: mp.MPObject) -> Any:
        out = mp.mpc.run(lambda x, y: jnp.maximum(x @ y, 0.25), mp.mpc.seal(p), mp.mpc.seal(q))
        return mp.mpc.reveal(out, to=0)

    with mp.Simulator(3) as sim:
        args = [sim.put(0, a), sim.put(1, b)]
        program = sim.compile(secure, *args)
        functions = {
            pfunc.digest: pfunc
            for rank in range(3)
            for pfunc in Interpreter(program.graph, rank).functions()
            if pfunc.fn_type == "jax.exec"
        }
        rounds = {d: f for d, f in functions.items() if f.fn_name.startswith("mpc.")}
        planned = {d: jax_exec._WRITTEN_PLANS.get(d) for d in rounds}
        assert len(rounds) >= 5 and [rounds[d].fn_name for d, p in planned.items() if not p] == []
        modules = []
        for digest, plan in planned.items():
            exported = jax.export.deserialize(bytearray(rounds[digest].fn_body))
            modules.append(exported.mlir_module_serialized)
            inputs = _random_inputs(rounds[digest].ins_info)
            with jax.enable_x64(True):
                want = [np.asarray(w) for w in jax.tree.leaves(exported.call(*inputs))]
            got = interpreted.call(plan, [inputs[k] for k in exported.module_kept_var_idx])
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
        got = sim.fetch(sim.evaluate(program, *args), party=0)
    np.testing.assert_allclose(got, np.maximum(a @ b, 0.25), atol=1e-4)
    assert len(jax_exec._WRITTEN_PLANS) == 0  # each plan was taken,
    assert not set(modules) & set(from_artifact)  # and no round was planned from its artifact

    closed = jax.make_jaxpr(lambda x: x * 3 + 1)(np.zeros(4, np.int32))
    elsewhere = emit.jaxpr_function("for.other.parties", closed, None)
    assert jax_exec._WRITTEN_PLANS.get(elsewhere.digest) is None
    with jax_exec.planning_written():
        here = emit.jaxpr_function("for.parties.here", closed, None)
    assert jax_exec._WRITTEN_PLANS.get(here.digest) is not None


def test_a_module_that_would_hold_big_values_in_numpy_is_compiled() -> None:
    big = np.zeros((20, 2**20), np.float32)  # 80 MiB: numpy would hold a * 2 apart, XLA fuses
    exported = _export(lambda a: (a * 2 + 1).sum(), big)
    with pytest.raises(interpreted.Unsupported, match="over 64 MiB"):
        interpreted.plan_serialized(exported.mlir_module_serialized)
    summed = _export(lambda a: a.sum(), big)  # reads it in place: planned, checked in chunks
    plan = interpreted.plan_serialized(summed.mlir_module_serialized)
    with pytest.raises(interpreted.NotExact, match="more terms"):
        interpreted.call(plan, [big])


def test_a_function_that_cannot_be_interpreted_is_compiled_once_and_kept_once(
    empty_cache: None,
) -> None:
    x = np.linspace(-1, 1, 8).astype(np.float32)
    pfunc = _pfunction(jnp.exp, x)
    runtimes = [KernelRuntime(rank=r, world_size=3) for r in range(3)]
    for runtime in runtimes:
        jax_exec.prepare_jax_exec(pfunc, runtime)
        assert not runtime.cache(jax_exec.CACHE_NAMESPACE).get(pfunc.digest).interpreted
    assert len(jax_exec._PROCESS_CACHE) == 1 and len(jax_exec._PLANS) == 0
    np.testing.assert_allclose(mp.invoke(pfunc, x, runtime=runtimes[2])[0], np.exp(x), rtol=1e-6)
