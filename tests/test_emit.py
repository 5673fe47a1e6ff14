"""Rounds written straight from their equations (`mpplug.mpc.emit`): bit for bit what the same
function gives exported by `jax.export`, op by op at the edges; refusals (`Unemittable`) for
what it does not write; and every round of a secure program against its `jax.export` twin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.interpreters import mlir as jax_mlir
from jax.extend import mlir
from jax.extend.mlir.dialects import stablehlo as hlo

import mpplug as mp
from mpplug.core import PFunction
from mpplug.frontend.jax_export import jax_export
from mpplug.kernels import KernelRuntime, interpreted, invoke, jax_exec
from mpplug.kernels.runtime import LRUCache
from mpplug.mpc import emit, prf, rounds

RNG = np.random.default_rng(11)
INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _edges(dtype: Any, shape: tuple[int, ...] = (4, 16)) -> np.ndarray:
    """Random values of `shape` with the dtype's extremes, 0, 1 (and -1, NaN, ±inf, ±0)."""
    dtype, n = np.dtype(dtype), int(np.prod(shape))
    if dtype == np.bool_:
        return RNG.integers(0, 2, shape).astype(bool)
    if dtype.kind == "f":
        special = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, np.inf, -np.inf, np.nan, 1e30]
        values = np.concatenate([special, RNG.standard_normal(n) * 1e3])[:n]
    else:
        info = np.iinfo(dtype)
        special = np.array([info.min, info.max, 0, 1, *([-1] if info.min < 0 else [])], dtype)
        drawn = RNG.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        values = np.concatenate([special, drawn])
    return values[:n].astype(dtype).reshape(shape)


def _emitted(fn: Callable[..., Any], *args: np.ndarray) -> Any:
    """`fn`'s jaxpr written by an `emit.Builder`, as a deserialized artifact."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    with jax.enable_x64(True):
        closed = jax.make_jaxpr(fn)(*specs)
    pfunc = emit.jaxpr_function("test", closed, ("cpu",))
    return jax.export.deserialize(bytearray(pfunc.fn_body)), pfunc


def _same_as_export(fn: Callable[..., Any], *args: np.ndarray) -> list[np.ndarray]:
    exported, pfunc = _emitted(fn, *args)
    with jax.enable_x64(True):
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        reference = jax.export.export(jax.jit(fn), platforms=("cpu",))(*specs)
        want = [np.asarray(w) for w in jax.tree.leaves(reference.call(*args))]
        got = [np.asarray(g) for g in jax.tree.leaves(exported.call(*args))]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        assert g.tobytes() == w.tobytes(), f"{fn}: {g} != {w}"
    assert pfunc.attrs[jax_exec.ATTR_KEPT_INPUTS] == tuple(range(len(args)))
    return got


def _run(pfunc: Any, args: list[np.ndarray]) -> list[np.ndarray]:
    """A PFunction's outputs: interpreted where a plan runs it (quicker), else compiled."""
    exported = jax.export.deserialize(bytearray(pfunc.fn_body))
    kept = [args[i] for i in exported.module_kept_var_idx]
    try:
        plan = interpreted.plan_serialized(exported.mlir_module_serialized)
        return [np.asarray(v) for v in interpreted.call(plan, kept)]
    except (interpreted.Unsupported, interpreted.NotExact):
        with jax.enable_x64(True):
            return [np.asarray(v) for v in jax.tree.leaves(exported.call(*kept))]


@pytest.mark.parametrize("dtype", INTS)
def test_integer_ops_wrap_and_shift_as_the_export(dtype: str) -> None:
    x, y = _edges(dtype), _edges(dtype)
    bits = np.dtype(dtype).itemsize * 8
    shifts = RNG.integers(0, bits + 5, x.shape).astype(dtype)

    def ops(x: jax.Array, y: jax.Array, s: jax.Array) -> tuple[jax.Array, ...]:
        return (
            x + y,
            x - y,
            x * y,
            x & y,
            x | y,
            x ^ y,
            ~x,
            -x,
            lax.max(x, y),
            lax.min(x, y),
            lax.shift_left(x, s),
            lax.shift_right_logical(x, s),
            lax.shift_right_arithmetic(x, s),
            lax.population_count(x),
            lax.div(x, y | np.array(1, x.dtype)),
            lax.rem(x, y | np.array(1, x.dtype)),
            lax.clamp(np.array(3, x.dtype), x, np.array(100, x.dtype)),
            x + np.array(7, x.dtype),
            *((lax.abs(x), lax.sign(x)) if np.dtype(dtype).kind == "i" else ()),
        )

    _same_as_export(ops, x, y, shifts)


@pytest.mark.parametrize("dtype", [*INTS, "float32", "float64", "bool"])
def test_compares_and_selects_as_the_export(dtype: str) -> None:
    x, y, which = _edges(dtype), _edges(dtype), _edges(np.bool_)

    def ops(x: jax.Array, y: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
        return (
            x == y,
            x != y,
            lax.lt(x, y),
            lax.le(x, y),
            lax.gt(x, y),
            lax.ge(x, y),
            lax.select(w, x, y),
            lax.select_n(w, x),
        )

    _same_as_export(ops, x, y, which)


def test_select_with_an_integer_case_index_picks_as_the_export() -> None:
    cases = [_edges(np.uint64) for _ in range(5)]
    which = RNG.integers(-2, 8, cases[0].shape).astype(np.int32)
    _same_as_export(
        lambda w, *c: lax.select_n(lax.clamp(np.int32(0), w, np.int32(4)), *c), which, *cases
    )


@pytest.mark.parametrize("source", [*INTS, "float32", "float64", "bool"])
def test_every_conversion_as_the_export(source: str) -> None:
    x = _edges(source)
    targets = [*INTS, "float32", "float64", "bool"]
    _same_as_export(lambda x: tuple(lax.convert_element_type(x, t) for t in targets), x)


def test_bitcasts_between_widths_as_the_export() -> None:
    x = _edges(np.uint64)
    _same_as_export(
        lambda x: (
            lax.bitcast_convert_type(x, np.int64),
            lax.bitcast_convert_type(x, np.uint32),
            lax.bitcast_convert_type(lax.bitcast_convert_type(x, np.uint8), np.uint64),
            lax.bitcast_convert_type(x, np.float64),
        ),
        x,
    )


def test_float_rounding_and_arithmetic_as_the_export() -> None:
    x, y = _edges(np.float32), _edges(np.float64)
    _same_as_export(
        lambda x, y: (
            jnp.round(x),
            lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
            jnp.floor(y),
            jnp.ceil(y),
            x * x + x / (x - 1.5),
            -y,
            lax.abs(x),
            lax.sign(x),
            lax.abs(y),
            lax.sign(y),
        ),
        x,
        y,
    )


def test_structure_ops_as_the_export() -> None:
    x = _edges(np.uint64, (4, 6))
    i = np.array(-3, np.int32)

    def ops(x: jax.Array, i: jax.Array) -> tuple[jax.Array, ...]:
        return (
            x.reshape(6, 4),
            x[1:3, ::2],
            x[:, None, :],
            jnp.squeeze(x[None]),
            jnp.stack([x, x + 1], axis=1),
            jnp.concatenate([x, x], axis=1),
            x.T,
            lax.rev(x, (0, 1)),
            lax.pad(x, np.uint64(9), ((1, -1, 1), (0, 2, 0))),
            lax.dynamic_slice(x, (i, np.int32(2)), (2, 3)),
            lax.dynamic_update_slice(x, x[:2, :2], (np.int32(3), i)),
            lax.iota(np.int32, 7),
            jnp.broadcast_to(x[0], (3, 6)),
            jnp.sum(x, axis=0),
            jnp.max(x.astype(np.int32), axis=1),
            jnp.min(x, axis=(0, 1)),
            jnp.all(x > 5, axis=1),
            jnp.any(x > 5),
            lax.reduce_xor_p.bind(x, axes=(1,)),
        )

    _same_as_export(ops, x, i)


@pytest.mark.parametrize("dtype", ["uint64", "int32", "float64", "float32"])
def test_dots_as_the_export(dtype: str) -> None:
    a = (_edges(np.int8, (2, 3, 4)) % 50).astype(dtype)
    b = (_edges(np.int8, (2, 4, 5)) % 50).astype(dtype)
    _same_as_export(
        lambda a, b: (
            lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))),
            lax.dot_general(a[0], b[0], (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST),
        ),
        a,
        b,
    )


@pytest.mark.parametrize("dtype", ["float64", "float32", "uint64"])
def test_convolutions_as_the_export(dtype: str) -> None:
    """NHWC and NCHW, strides, negative and positive padding, both dilations, feature groups."""
    x = (_edges(np.int8, (2, 7, 6, 4)) % 30).astype(dtype)
    k = (_edges(np.int8, (3, 2, 2, 6)) % 30).astype(dtype)
    _same_as_export(
        lambda x, k: (
            lax.conv_general_dilated(
                x, k, (2, 1), ((1, 0), (2, -1)), (1, 2), (2, 1), ("NHWC", "HWIO", "NHWC"), 2
            ),
            lax.conv_general_dilated(
                x.transpose(0, 3, 1, 2),
                k[:, :, :2].transpose(3, 2, 0, 1),
                (1, 1),
                "SAME",
                feature_group_count=2,
                precision=lax.Precision.HIGHEST,
            ),
        ),
        x,
        k,
    )


def test_gathers_that_clamp_as_the_export() -> None:
    """Indexing, `take` in clip mode (out-of-range indices too), batching dimensions."""
    x = _edges(np.uint64, (5, 3))
    i = np.array([4, 0, -2, 9, 3], np.int32)
    batched = lax.GatherDimensionNumbers(
        offset_dims=(),
        collapsed_slice_dims=(1,),
        start_index_map=(1,),
        operand_batching_dims=(0,),
        start_indices_batching_dims=(0,),
    )
    _same_as_export(
        lambda x, i: (
            x[jnp.clip(i, 0, 4)],
            jnp.take(x, i, axis=0, mode="clip"),
            jnp.take(x, i[:3], axis=1, mode="clip"),
            lax.gather(x, (i % 3)[:, None], batched, (1, 1), mode="clip"),
        ),
        x,
        i,
    )


def test_gathers_in_fill_mode_as_the_export() -> None:
    """`take` and indexing in fill mode: rows out of range (negative, past the end, a
    window reaching past it) are the fill value, of ints and floats, on either axis."""
    i = np.array([4, 0, -2, 9, 3, 5, -1], np.int32)
    starts = np.array([[0, 1], [4, 0], [3, 2], [-1, 0]], np.int32)
    windows = lax.GatherDimensionNumbers(
        offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0, 1)
    )
    for x, fill in ((_edges(np.uint64, (5, 3)), 7), (_edges(np.float32, (5, 3)), -0.0)):
        _same_as_export(
            lambda x, i, starts, fill=fill: (
                jnp.take(x, i, axis=0, mode="fill", fill_value=fill),
                jnp.take(x, i[:3], axis=1, mode="fill", fill_value=fill),
                jnp.take(x, i, axis=0, mode="fill"),
                lax.gather(x, starts, windows, (2, 2), mode="fill", fill_value=fill),
            ),
            x,
            i,
            starts,
        )


def test_integer_sorts_and_scatters_as_the_export() -> None:
    """Sorts by one integer key (with values carried along, on either axis, signed and
    unsigned, ties kept in order) and writes at indices, out-of-range ones dropped; those of
    a secure sort's rounds (sorts and writes into a vector) planned to run interpreted."""
    keys = np.array([[3, -1, 3, 0, 2**31 - 1, -(2**31), 3], [1, 1, 0, 0, 5, 5, 1]], np.int32)
    words = _edges(np.uint64, (2, 7))
    at = np.array([2, -1, 9, 0], np.int32)

    def rounds_ops(k: Any, w: Any, at: Any) -> Any:
        return (
            jnp.argsort(k, axis=1),
            jnp.argsort(w, axis=0),
            jnp.sort(w, axis=1),
            lax.sort((w, k), dimension=1, num_keys=1),
            k[0].at[at].set(k[1, :4], mode="drop"),
        )

    want = _same_as_export(rounds_ops, keys, words, at)
    exported, _ = _emitted(rounds_ops, keys, words, at)
    plan = interpreted.plan_serialized(exported.mlir_module_serialized)
    got = interpreted.call(plan, [keys, words, at])
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    _same_as_export(
        lambda w, at: w.at[at % 2].set(w[::-1], mode="promise_in_bounds"), words, at[:2]
    )


def test_constants_keep_their_bits() -> None:
    """Splats and arrays of constants, signed zeros, NaN payloads, bools and 64-bit extremes."""
    table = np.array([0.0, -0.0, np.nan, np.inf, 1e-310], np.float64)
    signs = np.array([-0.0] * 4, np.float32)
    flags = np.array([[True, False], [False, True]])
    words = np.array([2**64 - 1, 0, 2**63], np.uint64)
    x = _edges(np.float64, (5,))
    got = _same_as_export(
        lambda x: (x + table, signs, flags, words, jnp.zeros((3,), np.int8) - 1), x
    )
    assert np.signbit(got[1]).all()
    assert got[3].tolist() == words.tolist()


def test_inner_jit_calls_are_inlined() -> None:
    inner = jax.jit(lambda x, y: jnp.where(x > y, x - y, y - x))
    x, y = _edges(np.uint32), _edges(np.uint32)
    exported, _ = _emitted(lambda x, y: inner(x, y) * 3, x, y)
    assert "func.call" not in exported.mlir_module()
    _same_as_export(lambda x, y: inner(x, y) * 3, x, y)


@pytest.mark.parametrize(
    "fn, why",
    [
        (jnp.exp, "primitive exp"),
        (lambda x: jnp.sort(x, axis=0), "sort by 1 keys of float32"),
        (lambda x: lax.sort((x, x), num_keys=2)[0], "sort by 2 keys"),
        (lambda x: x.at[0].set(1.0, mode="clip"), "scatter in mode"),
        (lambda x: x.at[0].add(1.0), "primitive scatter-add"),
        (lambda x: jnp.cumsum(x), "primitive cumsum"),
        (
            lambda x: lax.dot_general(x, x.T.astype(np.float64), (((1,), (0,)), ((), ()))),
            "dot_general",
        ),
        (lambda x: x.astype(jnp.bfloat16), "element type bfloat16"),
        (lambda x: lax.sign(x.astype(np.uint32)), "sign of uint32"),
    ],
)
def test_what_it_does_not_write_is_refused(fn: Callable[..., Any], why: str) -> None:
    with pytest.raises(emit.Unemittable, match=why):
        _emitted(fn, _edges(np.float32))


def test_ops_the_results_do_not_need_are_left_out() -> None:
    def fn(x: Any) -> Any:
        unused = (x * 3, jnp.sum(x))  # noqa: F841 - traced, then dropped
        return x + 1

    x = np.arange(6, dtype=np.int32)
    exported, pfunc = _emitted(fn, x)
    text = exported.mlir_module()
    assert "stablehlo.add" in text
    assert "stablehlo.multiply" not in text and "stablehlo.reduce" not in text
    np.testing.assert_array_equal(_run(pfunc, [x])[0], x + 1)


def test_an_op_written_twice_is_written_once_and_scalars_broadcast_as_splats() -> None:
    def fn(x: Any) -> Any:
        twice = (x * 3) + (x * 3)  # one multiply
        return twice.reshape(2, 3).reshape(3, 2).reshape(6) + 1  # one reshape, no broadcast

    x = np.arange(6, dtype=np.int32)
    exported, pfunc = _emitted(fn, x)
    text = exported.mlir_module()
    assert text.count("stablehlo.multiply") == 1
    assert "stablehlo.broadcast_in_dim" not in text
    assert text.count("stablehlo.reshape") <= 1
    np.testing.assert_array_equal(_run(pfunc, [x])[0], 6 * x + 1)


def test_a_stack_unstacked_in_the_same_function_is_its_parts() -> None:
    """As a share program pairs a party's two shares and the next step splits them again:
    no slice, and the stack itself is left out where nothing else reads it."""

    def fn(x: Any, y: Any) -> Any:
        first, second = lax.unstack(jnp.stack([x + 1, y * 2], axis=1), 1)
        across = lax.unstack(jnp.stack([x, y]), 1)  # another axis: sliced as written
        return first - second, across[2]

    x, y = np.arange(12, dtype=np.uint64).reshape(4, 3), np.full((4, 3), 5, np.uint64)
    exported, _ = _emitted(fn, x, y)
    text = exported.mlir_module()
    assert text.count("stablehlo.slice") == 1 and text.count("stablehlo.concatenate") == 1
    got = _same_as_export(fn, x, y)
    np.testing.assert_array_equal(got[0], (x + 1) - (y * 2))
    np.testing.assert_array_equal(got[1], np.stack([x, y])[:, 2, :])


def test_slices_within_a_concatenate_of_slices_and_of_added_axes_read_their_source() -> None:
    """A slice within one operand of a concatenate is a slice of that operand, a slice of a
    slice one slice, a broadcast that only adds axes of one element a reshape (a reshape
    of it one reshape of its source), and an empty operand of a concatenate is dropped:
    the concatenate, the broadcast and every reshape here are left out."""

    def fn(x: Any, y: Any) -> Any:
        joined = lax.concatenate([x, y, lax.slice(x, (0, 0), (0, 3))], 0)
        part = lax.slice(joined, (4, 0), (6, 3))  # rows 0-1 of y
        inner = lax.slice(lax.slice(joined, (1, 0), (7, 3)), (2, 1), (4, 3), (2, 1))  # x[3, 1:]
        wide = lax.broadcast_in_dim(part, (1, 2, 1, 3), (1, 3))
        return wide.reshape(2, 3) + 1, inner

    x, y = np.arange(12, dtype=np.int32).reshape(4, 3), np.arange(100, 118, dtype=np.int32)
    y = y.reshape(6, 3)
    exported, _ = _emitted(fn, x, y)
    text = exported.mlir_module()
    assert text.count("stablehlo.slice") == 2, text
    for kind in ("concatenate", "broadcast_in_dim", "reshape"):
        assert f"stablehlo.{kind}" not in text, text
    got = _same_as_export(fn, x, y)
    np.testing.assert_array_equal(got[0], y[:2] + 1)
    np.testing.assert_array_equal(got[1], x[3:4, 1:])


def test_narrower_bits_of_a_reshape_are_one_reshape_of_its_sources_bits() -> None:
    """As a round reads a PRF stream as narrower words: a row, flattened, its bits, the
    view's shape. The bits are taken of the row itself, and the two reshapes are one."""

    def fn(x: Any) -> Any:
        row = lax.slice(x, (1, 0), (2, 6))
        words = lax.bitcast_convert_type(lax.reshape(row, (6,)), np.uint32)
        same = lax.bitcast_convert_type(lax.reshape(row, (3, 2)), np.int64)  # as wide
        return lax.reshape(words, (3, 4)), same

    x = (np.arange(12, dtype=np.uint64) * np.uint64(0x100000001)).reshape(2, 6)
    exported, _ = _emitted(fn, x)
    text = exported.mlir_module()
    assert text.count("stablehlo.reshape") == 2 and text.count("stablehlo.bitcast_convert") == 2
    assert "(tensor<6xui64>) -> tensor<6x2xui32>" not in text, text  # not of the flattened row
    got = _same_as_export(fn, x)
    np.testing.assert_array_equal(got[0], x[1].view(np.uint32).reshape(3, 4))
    np.testing.assert_array_equal(got[1], x[1].view(np.int64).reshape(3, 2))


def test_a_party_loads_what_this_process_wrote_or_read_without_deserializing_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))  # no executable found on disk
    x = np.arange(6, dtype=np.int32)
    _, written = _emitted(lambda v: v * 5, x)
    foreign = PFunction.from_bytes(_emitted(lambda v: v * 7, x)[1].to_bytes())
    jax_exec._EXPORTED.discard(foreign.digest)  # as if another process wrote it
    calls: list[int] = []
    deserialize = jax.export.deserialize

    def counting(body: Any) -> Any:
        calls.append(len(body))
        return deserialize(body)

    monkeypatch.setattr(jax_exec.jax_export, "deserialize", counting)
    runtime = KernelRuntime()
    np.testing.assert_array_equal(np.asarray(invoke(written, x, runtime=runtime)[0]), x * 5)
    assert calls == []
    np.testing.assert_array_equal(np.asarray(invoke(foreign, x, runtime=runtime)[0]), x * 7)
    assert len(calls) == 1
    untrusting = KernelRuntime(untrusted_artifacts=True)  # loads it again, checked this time
    np.testing.assert_array_equal(np.asarray(invoke(foreign, x, runtime=untrusting)[0]), x * 7)
    assert len(calls) == 1  # read once per process


@pytest.mark.parametrize("pick", [0, 1, 2])
def test_a_picked_prf_key_is_row_0_at_its_role_and_row_1_elsewhere(pick: int) -> None:
    keys = np.arange(16, dtype=np.uint32).reshape(2, 8)
    for role in (0, 1, 2, 5):  # a share program's roles, and one past them
        want = keys[0] if role == pick else keys[1]
        got = prf.picked_row(lax, keys, np.int32(role), pick)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"role {role}")
        specs = [jax.ShapeDtypeStruct((2, 8), np.uint32), jax.ShapeDtypeStruct((), np.int32)]
        pfunc = emit.round_function(
            "t", specs, lambda b, k, r: [prf.picked_row(b, k, r, pick)], ("cpu",)
        )
        np.testing.assert_array_equal(_run(pfunc, [keys, np.int32(role)])[0], want)


def test_an_emitted_artifact_declares_what_jax_export_declares() -> None:
    """An emitted round's artifact carries the fields (trees, types, calling convention,
    platforms, shardings, effects, kept inputs) that `jax.export` writes for the same function."""
    spec = jax.ShapeDtypeStruct((4,), np.uint64)

    def fn(a: Any, b: Any) -> Any:
        return a * b, a - b

    with jax.enable_x64(True):
        pfunc = emit.jaxpr_function("fn", jax.make_jaxpr(fn)(spec, spec), ["cpu"])
        want = jax.export.export(jax.jit(fn), platforms=("cpu",))(spec, spec)
    got = jax.export.deserialize(bytearray(pfunc.fn_body))
    fields = (
        "in_tree",
        "in_avals",
        "out_tree",
        "out_avals",
        "in_shardings_hlo",
        "out_shardings_hlo",
        "nr_devices",
        "platforms",
        "ordered_effects",
        "unordered_effects",
        "disabled_safety_checks",
        "calling_convention_version",
        "module_kept_var_idx",
        "uses_global_constants",
    )
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert pfunc.attrs[jax_exec.ATTR_CALLING_CONVENTION] == want.calling_convention_version


def test_several_platforms_are_refused() -> None:
    with pytest.raises(emit.Unemittable, match="several platforms"):
        emit.round_function("t", [], lambda b: [b.value(np.uint64(1))], ("cpu", "cuda"))


def test_every_round_of_a_secure_program_is_the_exports_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A product, a comparison, a secret gather: each round's emitted PFunction
    gives the bits its `jax.export` twin gives, on random shares; none falls back."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))
    emitted = emit.round_function
    checked: list[str] = []

    def twin(name: str, inputs: Any, segment: Any, platforms: Any) -> Any:
        pfunc = emitted(name, inputs, segment, platforms)

        def traced(*args: Any) -> Any:
            return segment(rounds.LAX, *args)

        with jax.enable_x64(True):
            reference, _, _ = jax_export(traced, *inputs, platforms=platforms, disk=False)
        args = [_edges(s.dtype, s.shape) for s in inputs]
        got, want = _run(pfunc, args), _run(reference, args)
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want], name
        checked.append(name)
        return pfunc

    monkeypatch.setattr(emit, "round_function", twin)

    @mp.function
    def secure(x: Any, y: Any, i: Any) -> Any:
        a, b, k = mp.mpc.seal(x, [0, 1, 2]), mp.mpc.seal(y, [0, 1, 2]), mp.mpc.seal(i, [0, 1, 2])
        out = mp.mpc.run(lambda a, b, k: (a * b + 2.0, a < b, jnp.take(a, k)), a, b, k)
        return mp.mpc.reveal(out, to=0)

    x = np.linspace(-3, 3, 8, dtype=np.float32)
    y = np.linspace(0.5, 4, 8, dtype=np.float32)
    i = np.array([3, 0, 7], np.int32)
    caplog.set_level(logging.DEBUG, logger="mpplug.mpc.rounds")
    with mp.Simulator(3) as sim:
        got = sim.fetch(sim.evaluate(secure, sim.put(0, x), sim.put(1, y), sim.put(2, i)), party=0)
    np.testing.assert_allclose(got[0], x * y + 2, atol=1e-4)
    np.testing.assert_array_equal(got[1], x < y)
    np.testing.assert_allclose(got[2], x[i], atol=1e-4)
    assert len(checked) > 10
    assert "exported by jax.export" not in caplog.text


def test_rounds_two_programs_share_are_written_once_and_are_the_same_function(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Round names say what a round sends, not which program it is in: a second program
    whose rounds are mostly the first's (here, a product followed by a different public
    step) gets the same PFunctions for them, without parsing and writing them again, so a
    party's plans and compiled code for them serve both."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))
    serialized, round_function = emit._serialized, emit.round_function
    parsed: list[str] = []
    written: list[list[PFunction]] = []

    def counting(text: str, planned: bool) -> tuple[bytes, Any]:
        parsed.append(text)
        return serialized(text, planned)

    def recorded(*args: Any) -> PFunction:
        pfunc = round_function(*args)
        written[-1].append(pfunc)
        return pfunc

    monkeypatch.setattr(emit, "_serialized", counting)
    monkeypatch.setattr(emit, "round_function", recorded)
    monkeypatch.setattr(emit, "_WRITTEN", LRUCache())  # none written by earlier tests

    def program(step: Callable[[Any], Any]) -> Any:
        @mp.function
        def secure(x: Any, y: Any) -> Any:
            a, b = mp.mpc.seal(x, [0, 1, 2]), mp.mpc.seal(y, [0, 1, 2])
            return mp.mpc.reveal(mp.mpc.run(lambda a, b: step(a * b), a, b), to=0)

        return secure

    x, y = np.float32([1.5, -2.0, 3.0]), np.float32([2.0, 4.0, -0.5])
    counts = []
    with mp.Simulator(3) as sim:
        for step, want in ((lambda p: p + 1.0, x * y + 1), (lambda p: p * 3.0, x * y * 3)):
            written.append([])
            before = len(parsed)
            got = sim.fetch(sim.evaluate(program(step), sim.put(0, x), sim.put(1, y)), party=0)
            np.testing.assert_allclose(got, want, atol=1e-3)
            counts.append(len(parsed) - before)
    first, second = ({p.digest for p in w} for w in written)
    assert counts == [len(first), len(second - first)] and len(second - first) <= 2, counts
    rounds = {p.fn_name for w in written for p in w if p.fn_name.startswith("mpc.")}
    assert "mpc.trunc.bits" in rounds and not any("lambda" in n for n in rounds), rounds


def test_every_round_comes_back_unchanged_from_jaxs_writer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Rounds are written by StableHLO's own writer, with their constants where JAX's writer
    would move them: JAX's writer (a party's module check) gives back the same bytes for
    every round of a program of products, compares, reductions, dots and a convolution."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(emit, "_WRITTEN", LRUCache())  # none written by earlier tests
    serialized = emit._serialized
    modules: list[bytes] = []

    def kept(text: str, planned: bool) -> tuple[bytes, Any]:
        module, plan = serialized(text, planned)
        modules.append(module)
        return module, plan

    monkeypatch.setattr(emit, "_serialized", kept)

    def model(w: Any, x: Any) -> Any:
        image = lax.conv(x.reshape(1, 1, 4, 4), w[None, None, :3, :3], (1, 1), "VALID")
        logits = jnp.dot(x, w) + 0.5
        return jnp.max(jax.nn.relu(logits), axis=1), jnp.sum(image, axis=(2, 3)), x < 1.0

    @mp.function
    def secure(w: Any, x: Any) -> Any:
        sw, sx = mp.mpc.seal(w, [0, 1, 2]), mp.mpc.seal(x, [0, 1, 2])
        return mp.mpc.reveal(mp.mpc.run(model, sw, sx), to=0)

    w = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    x = np.linspace(-2, 2, 16, dtype=np.float32).reshape(4, 4)
    with mp.Simulator(3) as sim:
        got = sim.fetch(sim.evaluate(secure, sim.put(0, w), sim.put(1, x)), party=0)
    want = model(w, x)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-3)
    assert len(modules) > 10
    version = emit._target_version()
    with jax_mlir.make_ir_context() as context:
        for module in modules:
            parsed = hlo.deserialize_portable_artifact(context, module)
            for with_sdy in (True, False):
                again = mlir.serialize_portable_artifact(parsed, version, with_sdy)
                assert bytes(again) == module


def _eqn(fn: Callable[..., Any], *args: Any) -> Any:
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return eqn


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (lambda x: -x, (np.float32(1.5),)),
        (lambda x, y: x / y, (np.float32(-1.0), np.float32(256.0))),
        (lax.div, (np.array([-7, 7, -8], np.int32), np.array([2, -2, 0], np.int32))),
        (lambda x: lax.broadcast_in_dim(x, (3, 2), (1,)), (np.array([0.25, -0.0], np.float32),)),
        (lax.shift_right_logical, (np.array([2**64 - 1, 8], np.uint64), np.full(2, 3, np.uint64))),
        (lambda: lax.iota(np.int32, 5), ()),
    ],
)
def test_a_public_constant_is_computed_with_xlas_bits_and_no_compile(
    fn: Any, args: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    eqn = _eqn(fn, *args)
    want = eqn.primitive.bind(*args, **eqn.params)  # JAX's own (compiled once per signature)
    from jax._src import compiler

    compiles: list[Any] = []
    monkeypatch.setattr(compiler, "backend_compile_and_load", lambda *a, **k: compiles.append(a))
    (got,) = emit.evaluated(eqn, list(args))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.asarray(want).tobytes() == got.tobytes()  # the same bits, -0.0 and all
    assert compiles == []


def test_a_constant_a_plan_cannot_give_exactly_is_left_to_jax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert emit.evaluated(_eqn(jnp.exp, np.float32(1.0)), [np.float32(1.0)]) is None  # XLA's own
    weak = _eqn(lambda x: x * 2, 3.0)  # a weakly typed result: a numpy array would not be
    assert emit.evaluated(weak, [3.0]) is None
    negated = _eqn(lambda x: -x, np.float32(1.5))

    def broken(*args: Any) -> Any:
        raise RuntimeError("a rule that did not foresee its parameters")

    monkeypatch.setitem(emit._RULES, "neg", broken)
    assert emit.evaluated(negated, [np.float32(1.5)]) is None  # bound by JAX instead


def test_a_secure_program_with_public_constant_math_is_the_one_jax_would_fold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The constants a secure function computes from public values (a mean's 1/n, a
    one-hot's iota) give the program JAX's own eager evaluation gives, byte for byte."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")  # traced anew each time

    labels = np.arange(8, dtype=np.int32) % 3

    def step(x: Any) -> Any:
        scale = -1.0 / jnp.float32(x.shape[0])
        onehot = jnp.asarray(labels)[:, None] == jnp.arange(3, dtype=np.int32)
        return (jnp.where(onehot, x, 0.0) * scale).sum(0)

    @mp.function
    def secure(x: mp.MPObject) -> mp.MPObject:
        return mp.mpc.reveal(mp.mpc.run(step, mp.mpc.seal(x)), to=0)

    x = RNG.standard_normal((8, 3)).astype(np.float32)
    with mp.Simulator(3) as sim:
        held = sim.put(0, x)
        folded = sim.compile(secure, held)
        got = sim.fetch(sim.evaluate(folded, held), party=0)
    monkeypatch.setattr(emit, "evaluated", lambda eqn, values: None)  # each bound by JAX
    with mp.Simulator(3) as sim:
        bound = sim.compile(secure, sim.put(0, x))
    assert folded.digest == bound.digest
    np.testing.assert_allclose(got, np.asarray(step(x)), atol=1e-4)


def test_a_public_constant_op_met_again_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    plan = emit._parsed_plan
    monkeypatch.setattr(emit, "_parsed_plan", lambda text: parsed.append(text) or plan(text))
    eqn = _eqn(lambda x, y: x * y, np.arange(5, dtype=np.float32), np.float32(3.0))
    firsts = [
        emit.evaluated(eqn, [np.arange(5, dtype=np.float32) + i, np.float32(i)]) for i in range(4)
    ]
    assert [list(f[0]) for f in firsts] == [list((np.arange(5) + i) * i) for i in range(4)]
    assert len(parsed) <= 1  # planned at most once (not at all where an earlier test planned it)
