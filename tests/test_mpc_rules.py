"""Every `mp.mpc` rule against plaintext numpy/JAX, on the Simulator.

Inputs are random (fixed seeds) with negatives, zeros and large magnitudes; the shares'
randomness is fresh on every run. What the checks promise:

- ring-linear ops (add, sub, neg, sums, element moves, pad, concatenate) are exact: the float
  result equals numpy on the inputs rounded to the fixed-point grid (`grid`, 2^-18);
- integers are exact, wrapping mod 2^64 like numpy int64 (a revealed int32 like int32);
- comparisons, selections, max/min/abs/sign, argmax and float -> int (toward zero, as JAX) are
  exact on grid-rounded values;
- one fixed-point product or dot (one truncation) lies within one ulp (2^-18) of the exact
  product of the rounded inputs: precise truncation gives the floor or one above it
  (tests/test_mpc_exactness.py checks that bound on millions of products up to the range);
- approximations stay within `APPROX_BOUNDS`, measured on the input ranges their docstrings
  give and pinned with a 2-3x margin.

Each program costs seconds of XLA compilation per round, so many ops share one program, and
each program belongs to one test: a program shared by several tests would be compiled again by
every pytest-xdist worker that runs one of them. `Checks` lists every mismatch of a test.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpplug as mp
from mpplug.errors import TraceError
from simulator import Simulator

F = mp.mpc.DEFAULT_FRAC_BITS
ULP = 2.0**-F
TIMEOUT = 180.0  # a receive may wait while its sender's round compiles on a loaded machine


def grid(x: Any) -> np.ndarray:
    """`x` rounded to the fixed-point grid, as `seal` encodes it."""
    return np.round(np.asarray(x, np.float64) * 2.0**F) / 2.0**F


Layout = list[tuple[str, str, int, tuple[int, ...]]]


def pack(arrays: dict[str, Any], xp: Any = np) -> tuple[dict[str, Any], Layout]:
    """Arrays as one flat vector per dtype, and where each one lies in them."""
    groups: dict[str, list[Any]] = {}
    layout: Layout = []
    for name, a in arrays.items():
        key = np.dtype(a.dtype).str
        start = sum(v.size for v in groups.get(key, []))
        groups.setdefault(key, []).append(xp.ravel(a))
        layout.append((name, key, start, tuple(a.shape)))
    return {k: xp.concatenate(v) for k, v in groups.items()}, layout


def unpack(vectors: dict[str, Any], layout: Layout) -> dict[str, Any]:
    return {
        name: vectors[key][start : start + math.prod(shape)].reshape(shape)
        for name, key, start, shape in layout
    }


def secure(
    fn: Callable[..., dict[str, Any]],
    secrets: dict[str, np.ndarray],
    public: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """`fn(secrets, public)` (a dict of outputs) under `mp.mpc.run`, revealed to party 0.

    The secrets are packed into one vector per dtype, the k-th sealed by party k % 3, and
    non-bool outputs likewise: each sealed leaf costs a compiled `split`, each revealed one a
    `combine`. Public values are put at party 0 and broadcast before the run.
    """
    vectors, layout = pack(secrets)
    out_layouts: list[Layout] = []

    def packed(sealed: dict[str, Any], shared: dict[str, Any]) -> Any:
        outs = fn(unpack(sealed, layout), shared)
        numbers, out_layout = pack({k: v for k, v in outs.items() if v.dtype != bool}, jnp)
        out_layouts.append(out_layout)
        return numbers, {k: v for k, v in outs.items() if v.dtype == bool}

    @mp.function
    def program(secret_values: Any, public_values: Any) -> Any:
        sealed = mp.mpc.seal(secret_values, parties=[0, 1, 2])
        shared = {k: mp.bcast(0, v) for k, v in public_values.items()}
        return mp.mpc.reveal(mp.mpc.run(packed, sealed, shared), to=0)

    with Simulator(3, timeout=TIMEOUT) as sim:
        handles = {k: sim.put(i % 3, v) for i, (k, v) in enumerate(vectors.items())}
        shared = {k: sim.put(0, v) for k, v in (public or {}).items()}
        numbers, bools = jax.tree.map(
            lambda h: sim.fetch(h, party=0), sim.evaluate(program, handles, shared)
        )
    return {**unpack(numbers, out_layouts[-1]), **bools}


class Checks:
    """Collects every mismatch of a test and fails once, listing them all."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __enter__(self) -> Checks:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            assert not self.failures, "\n".join(self.failures)

    def _shape(self, name: str, got: np.ndarray, want: np.ndarray, dtype: Any) -> bool:
        if got.shape != want.shape or (dtype is not None and got.dtype != np.dtype(dtype)):
            self.failures.append(
                f"{name}: got {got.dtype}{list(got.shape)}, expected "
                f"{np.dtype(dtype) if dtype is not None else want.dtype}{list(want.shape)}"
            )
            return False
        return True

    def exact(self, name: str, got: Any, want: Any, dtype: Any = None) -> None:
        got, want = np.asarray(got), np.asarray(want)
        if self._shape(name, got, want, dtype) and not np.array_equal(got, want):
            bad = np.argwhere(got != want)
            i = tuple(bad[0])
            self.failures.append(
                f"{name}: {len(bad)} of {got.size} differ, first at {i}: got {got[i]!r}, "
                f"expected {want[i]!r}"
            )

    def close(
        self, name: str, got: Any, want: Any, atol: float, rtol: float = 0.0, dtype: Any = None
    ) -> None:
        """|got - want| <= atol + rtol |want| everywhere."""
        got, want = np.asarray(got), np.asarray(want, np.float64)
        if not self._shape(name, got, want, dtype):
            return
        err = np.abs(got.astype(np.float64) - want)
        bound = np.broadcast_to(atol + rtol * np.abs(want), err.shape)  # bounds may vary
        bad = err > bound
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, err, -1)), err.shape)
            self.failures.append(
                f"{name}: {bad.sum()} of {bad.size} outside atol + rtol |want| ({bound[i]:g} "
                f"there); worst at {tuple(int(k) for k in i)}: got {got[i]!r}, expected "
                f"{want[i]!r}"
            )


# -- arithmetic, moves, conversions, integers (one program) -----------------------------------


def _floats(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Uniform in [-scale, scale] with zeros and tiny values planted."""
    x = rng.uniform(-scale, scale, shape)
    flat = x.reshape(-1)
    flat[::7] = 0.0
    flat[3::11] = rng.uniform(-1e-4, 1e-4, flat[3::11].shape)
    return x


def _arith_inputs() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(20261203)
    big = rng.uniform(-1e9, 1e9, (4, 6))
    big[0, :3] = [2.0**34, -(2.0**34), 0.0]
    i = rng.integers(-(2**62), 2**62, (4, 6), dtype=np.int64)
    j = rng.integers(-(2**62), 2**62, (4, 6), dtype=np.int64)
    i[0, :4] = [2**63 - 1, -(2**63), 0, -1]
    j[0, :4] = [1, -1, 5, -1]  # overflow on add and sub, then plain values
    secrets = {
        "x": _floats(rng, (4, 6), 4.0),
        "y": _floats(rng, (4, 6), 4.0),
        "big": big,
        "m": _floats(rng, (6, 3), 4.0),
        "bx": _floats(rng, (2, 3, 4), 4.0),
        "by": _floats(rng, (2, 4, 5), 4.0),
        "w": _floats(rng, (6, 2), 1.0),
        "t": _floats(rng, (4, 2), 2.0),
        "i": i,
        "j": j,
        "im": rng.integers(-(2**40), 2**40, (6, 3), dtype=np.int64),
        "small": rng.integers(-50, 50, (4, 6), dtype=np.int64),
    }
    p = rng.choice([-1.0, 1.0], 6) * rng.uniform(0.5, 4.0, 6)  # a divisor away from 0
    public = {"p": p, "pm": rng.uniform(-2, 2, (6, 3))}
    return secrets, public


def _loss(w: jnp.ndarray, x: jnp.ndarray, t: jnp.ndarray) -> jnp.ndarray:
    return jnp.mean((x @ w - t) ** 2)


def _arith(s: dict[str, jnp.ndarray], pub: dict[str, jnp.ndarray]) -> dict[str, Any]:
    x, y, big, i, j = s["x"], s["y"], s["big"], s["i"], s["j"]
    less = x < y
    i32 = i.astype(jnp.int32)  # the low 32 bits, as numpy's astype
    return {
        # ring-linear, exact
        "add": x + y,
        "sub": x - y,
        "neg": -x,
        "add_big": big + x,
        "sub_big": big - y,
        "add_public": x + pub["p"],
        "add_const": x + 2.5,
        "reduce_sum": x.sum(axis=0),
        "reduce_sum_big": big.sum(),
        "broadcast_in_dim": jnp.broadcast_to(x[:, :1], (4, 6)) + x[0],
        "reshape": x.reshape(3, 8),
        "transpose": x.T,
        "squeeze": jnp.squeeze(x[:, 1:2], axis=1),
        "expand_dims": jnp.expand_dims(x, 1),
        "slice": x[1:3, ::2],
        "concatenate": jnp.concatenate([x, big], axis=1),
        "pad": lax.pad(x, 1.5, ((1, 0, 1), (0, -2, 0))),
        # one truncation
        "mul": x * y,
        "mul_public": x * pub["p"],
        "mul_const": x * 2.5,
        "matmul": x @ s["m"],
        "einsum": jnp.einsum("ij,kj->ik", x, y),
        "batched": s["bx"] @ s["by"],
        "matmul_public": x @ pub["pm"],
        "div_const": x / 3.0,
        "div_public": x / pub["p"],
        "mean": x.mean(),
        "centered": x - x.mean(),  # a secret scalar against an array
        "scaled": x * x.mean(),
        "square": x**2,
        "cube": x**3,
        "grad": jax.grad(_loss)(s["w"], x, s["t"]),
        # integers: exact mod 2^64
        "int_add": i + j,
        "int_sub": i - j,
        "int_neg": -i,
        "int_mul": i * j,
        "int_mul_const": i * 3,
        "int_matmul": i @ s["im"],
        "int_sum": i.sum(axis=1),
        "int_cube": s["small"] ** 3,
        "int32_mul": i32 * i32,
        # conversions
        "int_to_float": s["small"].astype(jnp.float64),
        "bool_to_float": less.astype(jnp.float64),
        "bool_to_int": less.astype(jnp.int64),
        "to_float32": x.astype(jnp.float32),
        "float32_mul": x.astype(jnp.float32) * 2.5,
    }


def test_arithmetic_moves_conversions_and_integers():
    s, pub = _arith_inputs()
    out = secure(_arith, s, pub)
    x, y, big = grid(s["x"]), grid(s["y"]), grid(s["big"])
    p, pm = grid(pub["p"]), grid(pub["pm"])
    i, j, small = s["i"], s["j"], s["small"]
    with Checks() as check:
        # ring-linear: exact on the grid
        check.exact("add", out["add"], x + y, np.float64)
        check.exact("sub", out["sub"], x - y)
        check.exact("neg", out["neg"], -x)
        check.exact("add_big", out["add_big"], big + x)
        check.exact("sub_big", out["sub_big"], big - y)
        check.exact("add_public", out["add_public"], x + p)
        check.exact("add_const", out["add_const"], x + 2.5)
        check.exact("reduce_sum", out["reduce_sum"], x.sum(axis=0))
        check.exact("reduce_sum_big", out["reduce_sum_big"], big.sum())
        check.exact("broadcast_in_dim", out["broadcast_in_dim"], x[:, :1] + x[0])
        check.exact("reshape", out["reshape"], x.reshape(3, 8))
        check.exact("transpose", out["transpose"], x.T)
        check.exact("squeeze", out["squeeze"], x[:, 1])
        check.exact("expand_dims", out["expand_dims"], x[:, None])
        check.exact("slice", out["slice"], x[1:3, ::2])
        check.exact("concatenate", out["concatenate"], np.concatenate([x, big], axis=1))
        padded = np.asarray(lax.pad(jnp.asarray(x), 1.5, ((1, 0, 1), (0, -2, 0))))
        check.exact("pad", out["pad"], padded)

        # one truncation: within one ulp of the exact product of the rounded inputs
        check.close("mul", out["mul"], x * y, ULP, dtype=np.float64)
        check.close("mul_public", out["mul_public"], x * p, ULP)
        check.close("mul_const", out["mul_const"], x * 2.5, ULP)
        check.close("matmul", out["matmul"], x @ grid(s["m"]), ULP)
        check.close("einsum", out["einsum"], np.einsum("ij,kj->ik", x, y), ULP)
        check.close("batched", out["batched"], grid(s["bx"]) @ grid(s["by"]), ULP)
        check.close("matmul_public", out["matmul_public"], x @ pm, ULP)
        check.close("square", out["square"], x**2, ULP)
        # x^3 = x^2 x: the square's ulp grows by |x| <= 4, then one more
        check.close("cube", out["cube"], x**3, 10 * ULP)
        # x / c multiplies by 1/c rounded to the grid (error <= 2^-19 |x|; a constant below
        # 1 gets extra fraction bits, so less), then truncates
        top = np.abs(x).max()
        check.close("div_const", out["div_const"], x / 3.0, ULP + top * ULP / 2)
        check.close("div_public", out["div_public"], x / p, ULP + top * ULP / 2)
        mean_bound = ULP + np.abs(x.sum()) * ULP / 2
        check.close("mean", out["mean"], x.mean(), mean_bound)
        check.close("centered", out["centered"], x - x.mean(), mean_bound)
        check.close("scaled", out["scaled"], x * out["mean"], ULP)
        # jax.grad inside the run: a handful of truncations, scaled by |x| <= 4 in the last
        # dot (5.2 ulp measured over 200 runs; cube 3.8, the divisions 1.3 and 2.2)
        grad = np.asarray(jax.grad(_loss)(grid(s["w"]), x, grid(s["t"])))
        check.close("grad", out["grad"], grad, 15 * ULP, dtype=np.float64)

        # integers: exact, wrapping mod 2^64 like numpy int64 (int32: mod 2^32)
        with np.errstate(over="ignore"):
            check.exact("int_add", out["int_add"], i + j, np.int64)
            check.exact("int_sub", out["int_sub"], i - j, np.int64)
            check.exact("int_neg", out["int_neg"], -i, np.int64)
            check.exact("int_mul", out["int_mul"], i * j, np.int64)
            check.exact("int_mul_const", out["int_mul_const"], i * 3, np.int64)
            check.exact("int_matmul", out["int_matmul"], i @ s["im"], np.int64)
            check.exact("int_sum", out["int_sum"], i.sum(axis=1), np.int64)
            check.exact("int_cube", out["int_cube"], small**3, np.int64)
            i32 = i.astype(np.int32)
            check.exact("int32_mul", out["int32_mul"], i32 * i32, np.int32)

        # conversions
        check.exact("int_to_float", out["int_to_float"], small.astype(np.float64), np.float64)
        less = (x < y).astype(np.int64)
        check.exact("bool_to_float", out["bool_to_float"], less.astype(np.float64), np.float64)
        check.exact("bool_to_int", out["bool_to_int"], less, np.int64)
        check.exact("to_float32", out["to_float32"], x.astype(np.float32), np.float32)
        check.close("float32_mul", out["float32_mul"], x * 2.5, ULP, dtype=np.float32)

    # the inputs really overflow: the wrap is what is tested
    exact = i.astype(object) * j.astype(object)
    assert sum(not -(2**63) <= v < 2**63 for v in exact.ravel()) > 12
    assert not -(2**63) <= int(i[0, 0]) + int(j[0, 0]) < 2**63


# -- comparisons and selections --------------------------------------------------------------


def _compare_inputs() -> dict[str, np.ndarray]:
    """Each rule sees one vector of cases: small values with ties and zeros, then values
    near 1e9 one ulp apart or equal; integers near 2^60 with ties and off-by-ones."""
    rng = np.random.default_rng(7)
    x = _floats(rng, (24,), 10.0)
    y = _floats(rng, (24,), 10.0)
    y[:4] = x[:4]
    y[4:6] = 0.0
    big = rng.uniform(-1e9, 1e9, 16)
    big2 = big + np.resize([-ULP, 0.0, ULP, 1e6], 16)
    i = rng.integers(-(2**60), 2**60, 16, dtype=np.int64)
    j = rng.integers(-(2**60), 2**60, 16, dtype=np.int64)
    j[:3] = i[:3]
    j[3:6] = i[3:6] + np.array([1, -1, 2**40])
    return {
        "x": np.concatenate([x, big]),
        "y": np.concatenate([y, big2]),
        "i": i,
        "j": j,
    }


ORDERS = ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")
"""lt, le, gt, ge, eq, ne: the jnp and np functions of these names bind them."""


def _comparisons(s: dict[str, jnp.ndarray], _: Any) -> dict[str, Any]:
    x, y, i, j = s["x"], s["y"], s["i"], s["j"]
    out: dict[str, Any] = {name: getattr(jnp, name)(x, y) for name in ORDERS}
    less, equal, less_int = out["less"], out["equal"], i < j
    out.update(
        {
            "less_int": less_int,
            "less_public": x < 0.5,  # a public operand, lifted to shares
            "greater_public": x > 0.5,  # lt(0.5, x): the public side on the left
            "where": jnp.where(less, x, 0.0),  # jnp.where and jnp.pad are jitted: inlined
            "pad": jnp.pad(x, 1),
            "select_n": lax.select(less, x, y),
            "select_n_int": lax.select(less_int, i, j * 2),
            "and": less & equal,
            "or": less | equal,
            "xor": less ^ equal,
            "not": ~less,
            "max": jnp.maximum(x, y),
            "min": jnp.minimum(x, y),
            "abs": jnp.abs(x),
            "sign": jnp.sign(x),
        }
    )
    return out


def test_comparisons_selections_and_logic_are_exact():
    s = _compare_inputs()
    out = secure(_comparisons, s)
    x, y, i, j = grid(s["x"]), grid(s["y"]), s["i"], s["j"]
    assert (x == y).sum() >= 8 and (i == j).sum() == 3  # ties are among the cases
    with Checks() as check:
        for name in ORDERS:
            check.exact(name, out[name], getattr(np, name)(x, y), np.bool_)
        check.exact("less_int", out["less_int"], i < j, np.bool_)
        check.exact("less_public", out["less_public"], x < 0.5, np.bool_)
        check.exact("greater_public", out["greater_public"], x > 0.5, np.bool_)
        check.exact("where", out["where"], np.where(x < y, x, 0.0), np.float64)
        check.exact("pad", out["pad"], np.pad(x, 1), np.float64)
        check.exact("select_n", out["select_n"], np.where(x < y, x, y), np.float64)
        check.exact("select_n_int", out["select_n_int"], np.where(i < j, i, j * 2), np.int64)
        check.exact("and", out["and"], (x < y) & (x == y), np.bool_)
        check.exact("or", out["or"], (x < y) | (x == y), np.bool_)
        check.exact("xor", out["xor"], (x < y) ^ (x == y), np.bool_)
        check.exact("not", out["not"], ~(x < y), np.bool_)
        check.exact("max", out["max"], np.maximum(x, y), np.float64)
        check.exact("min", out["min"], np.minimum(x, y), np.float64)
        check.exact("abs", out["abs"], np.abs(x), np.float64)
        check.exact("sign", out["sign"], np.sign(x), np.float64)


def test_argmax_and_min_over_an_axis_and_float_to_int():
    rng = np.random.default_rng(8)
    distinct = rng.permutation(np.arange(-12.0, 12.0) * 1.5).reshape(6, 4)
    ties = np.array([[1.0, 5.0, 5.0, 0.0], [-2.0, -2.0, -3.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    rows = np.concatenate([distinct, ties])  # a tie goes to the first index, as in jnp
    fractions = np.concatenate([[2.5, -2.5, 0.75, -0.75, 3.0, -3.0], rng.uniform(-1e3, 1e3, 58)])
    s = {"rows": rows, "fractions": fractions}
    out = secure(
        lambda v, _: {
            "argmax": jnp.argmax(v["rows"], axis=1),
            "reduce_min": jnp.min(v["rows"], axis=1),
            "to_int": v["fractions"].astype(jnp.int64),
        },
        s,
    )
    with Checks() as check:
        # a tournament with indices (argmax) and one without, the other way (min)
        check.exact("argmax", out["argmax"], np.argmax(rows, axis=1), np.int64)
        check.exact("reduce_min", out["reduce_min"], rows.min(axis=1), np.float64)
        # toward zero, as JAX (and numpy's astype) convert
        check.exact("to_int", out["to_int"], grid(fractions).astype(np.int64), np.int64)


# -- approximations (two programs) -------------------------------------------------------------


def _log_uniform(rng: np.random.Generator, low: float, high: float, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(low), np.log(high), n))


def _approx_inputs() -> dict[str, np.ndarray]:
    """Each function's documented input range (approx.py), ends included: exp down to -500
    and up to 17.9, logistic and tanh far beyond where they saturate."""
    rng = np.random.default_rng(11)
    n = 1024
    sign = rng.choice([-1.0, 1.0], n)
    exp_edges = [-500.0, -100.0, -16.0, -8.0, 0.0, 4.0, 8.0, 12.0, 17.0, 17.9]
    return {
        "exp": np.concatenate([exp_edges, rng.uniform(-16, 8, n - len(exp_edges))]),
        "log": np.concatenate([[0.01, 1.0, 100.0], _log_uniform(rng, 0.01, 100, n - 3)]),
        "reciprocal": np.concatenate(
            [[0.1, -0.1, 150.0, -150.0], (sign * _log_uniform(rng, 0.1, 150, n))[4:]]
        ),
        "numerator": rng.uniform(-10, 10, n),
        "sqrt": np.concatenate([[0.1, 1.0, 100.0], _log_uniform(rng, 0.1, 100, n - 3)]),
        "logistic": np.concatenate(
            [[-1e4, -600.0, -16.0, 0.0, 16.0, 600.0, 1e4], rng.uniform(-16, 16, n - 7)]
        ),
    }


APPROXIMATIONS: dict[str, Callable[[dict[str, jnp.ndarray]], jnp.ndarray]] = {
    "exp": lambda s: jnp.exp(s["exp"]),
    "log": lambda s: jnp.log(s["log"]),
    "sqrt": lambda s: jnp.sqrt(s["sqrt"]),
    "rsqrt": lambda s: lax.rsqrt(s["sqrt"]),
    "reciprocal": lambda s: jnp.reciprocal(s["reciprocal"]),  # integer_pow y=-1
    "div_secret": lambda s: s["numerator"] / s["reciprocal"],
    "logistic": lambda s: jax.nn.sigmoid(s["logistic"]),
    "tanh": lambda s: jnp.tanh(s["logistic"]),
}


def _approx_reference(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "exp": np.exp(s["exp"]),
        "log": np.log(s["log"]),
        "reciprocal": 1.0 / s["reciprocal"],
        "div_secret": s["numerator"] / s["reciprocal"],
        "sqrt": np.sqrt(s["sqrt"]),
        "rsqrt": 1.0 / np.sqrt(s["sqrt"]),
        "logistic": 0.5 * (1.0 + np.tanh(s["logistic"] / 2)),  # no overflow at +-1e4
        "tanh": np.tanh(s["logistic"]),
    }


APPROX_BOUNDS: dict[str, tuple[float, float]] = {
    # |got - want| <= atol + rtol |want| against float64, on the ranges of _approx_inputs.
    # Largest errors measured over 300 runs of 256 inputs (76,800 samples each), pinned at
    # 2.5-3x. exp is checked separately (its method's own error is not noise).
    "log": (2e-3, 0.0),  # 5.3e-4 on [0.01, 100] (one run of 20,000)
    "reciprocal": (3 * ULP, 1e-4),  # 1 ulp + 3e-5 relative
    "div_secret": (25 * ULP, 1e-4),  # 8 ulp + 3e-5 relative
    "sqrt": (4 * ULP, 3e-5),  # 1.3 ulp + 1e-5 relative
    "rsqrt": (8 * ULP, 3e-4),  # 2.4 ulp + 1e-4 relative
    "logistic": (1e-4, 0.0),  # 2.4e-5 on [-16, 16] (one run of 20,000; docstring: 5e-5)
    "tanh": (1.5e-4, 0.0),  # 4.0e-5 on [-8, 8]
}
EXP_FIXED_POINT_RTOL = 5e-5
"""exp against its method (1 + t + t^2/2)^256, t = x/256, beyond 4 ulp: its squarings run at
up to 30 fraction bits, so rounding adds under 1e-5 relative where e^x is above 1 and under
3 ulp below (3 runs of 20,000 inputs on each of [-4, 4], [0, 8], [8, 17.5] and [-16, 0])."""


def check_approximations(names: tuple[str, ...]) -> None:
    """The approximations `names`, run in one program, against APPROX_BOUNDS."""
    s = _approx_inputs()
    out = secure(lambda v, _: {name: APPROXIMATIONS[name](v) for name in names}, s)
    want = _approx_reference(s)
    with Checks() as check:
        for name in names:
            if name != "exp":
                atol, rtol = APPROX_BOUNDS[name]
                check.close(name, out[name], want[name], atol, rtol, dtype=np.float64)
                continue
            # exp: its method's own error (exact, deterministic) plus fixed-point error
            x = grid(s["exp"])
            t = x / 256
            method_error = np.abs((1 + t + t**2 / 2) ** 256 - want["exp"])
            bound = 4 * ULP + method_error
            check.close("exp", out["exp"], want["exp"], bound, EXP_FIXED_POINT_RTOL)
            # ... which stays within the docstring's |x|^3/393,216 plus 1e-5 of rounding
            # (and 4 ulp where e^x is below the resolution)
            docstring = np.abs(x) ** 3 / 393_216 + 1e-5
            check.close("exp (docstring)", out["exp"], want["exp"], 4 * ULP, docstring)


# Two programs of about the same compile time, so that two pytest-xdist workers share them.
@pytest.mark.slow
def test_exp_log_sqrt_rsqrt_within_pinned_bounds():
    check_approximations(("exp", "log", "sqrt", "rsqrt"))


@pytest.mark.slow
def test_reciprocal_division_logistic_tanh_within_pinned_bounds():
    check_approximations(("reciprocal", "div_secret", "logistic", "tanh"))


# -- errors, placement, repr and IR ------------------------------------------------------------


def _sealed_run(fn: Callable[..., Any]) -> Any:
    @mp.function
    def program(a: Any) -> Any:
        return mp.mpc.run(fn, mp.mpc.seal(a))

    return program


def _run_with_bad_primitive(x: jnp.ndarray) -> jnp.ndarray:
    return lax.digamma(x) + 1.0


@pytest.mark.parametrize(
    ("fn", "primitive"),
    [
        (lax.lgamma, "lgamma"),
        (lambda x: lax.igamma(x, x + 1.0), "igamma"),
        (_run_with_bad_primitive, "digamma"),
    ],
    ids=["lgamma", "igamma", "user_function"],
)
def test_a_primitive_without_a_rule_is_a_trace_error_naming_it(fn, primitive):
    a = mp.MPObject(np.zeros(3), 0)
    with pytest.raises(TraceError) as info:
        mp.compile(_sealed_run(fn), a, world_size=3)
    message = str(info.value)
    assert f"no secure rule for the JAX primitive {primitive!r}" in message
    assert "mp.mpc.run(" in message
    if fn is _run_with_bad_primitive:  # the user's own line is named
        line = inspect.getsourcelines(_run_with_bad_primitive)[1] + 1
        assert f"(from test_mpc_rules.py:{line})" in message


def test_seal_without_parties_in_a_four_party_world_asks_for_them():
    @mp.function
    def program(a: Any) -> Any:
        return mp.mpc.seal(a)

    with pytest.raises(TraceError, match=r"world has 4 parties.*parties=\["):
        mp.compile(program, mp.MPObject(np.zeros(3), 0), world_size=4)


def test_a_party_outside_the_computing_set_seals_and_learns_the_result():
    @mp.function
    def program(outsider: Any, inside: Any) -> Any:
        x, y = mp.mpc.seal((outsider, inside), parties=[0, 1, 2])
        return mp.mpc.reveal(mp.mpc.run(lambda a, b: a * b - a, x, y), to=3)

    x = np.array([1.5, -2.25, 3.0, 0.0])
    y = np.array([-4.0, 0.5, 3.0, 2.0])
    with Simulator(4, timeout=TIMEOUT) as sim:
        result = sim.evaluate(program, sim.put(3, x), sim.put(0, y))
        assert result.parties == {3}
        np.testing.assert_array_equal(sim.fetch(result, party=3), x * y - x)  # dyadic: exact
        assert sim.fetch(result)[:3] == [None, None, None]


def test_sealed_repr_and_program_ir_name_the_mpc_steps():
    seen: list[str] = []

    @mp.function
    def program(a: Any, b: Any) -> Any:
        x, y = mp.mpc.seal((a, b))
        seen.append(repr(x))
        product = mp.mpc.run(lambda u, v: u * v, x, y)
        seen.append(repr(product))
        return mp.mpc.run(lambda u, v: u < v, mp.mpc.seal(b), y), product

    ints = mp.MPObject(np.zeros((2, 3), np.int32), 1)
    ir = mp.compile(program, mp.MPObject(np.zeros((2, 3)), 0), ints, world_size=3).ir()
    assert seen == ["Sealed(f64[2,3] @ aby3{0,1,2}, fxp18)"] * 2
    for name in ("mpc.", "trunc.pair", "trunc.bits", "and.reshare", "jax.exec:split"):
        assert name in ir, name
    assert "shuffle" in ir


@pytest.mark.parametrize("frac_bits", [6, 12, 24])
def test_exp_runs_at_any_fixed_point_precision(frac_bits: int):
    """exp's squarings keep up to 30 fraction bits, as many as the range allows at each
    precision (at 6 bits t^2/2 is still truncated, never shifted up)."""
    x = np.array([-3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.0], np.float32)

    @mp.function
    def program(v: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(jnp.exp, mp.mpc.seal(v, frac_bits=frac_bits)), to=0)

    with mp.Simulator(3) as sim:
        got = np.asarray(sim.fetch(sim.evaluate(program, sim.put(0, x)), party=0), np.float64)
    want = np.exp(x.astype(np.float64))
    t = x.astype(np.float64) / 256
    method = np.abs((1 + t + t**2 / 2) ** 256 - want)
    np.testing.assert_array_less(np.abs(got - want), method + 8 * 2.0**-frac_bits + 1e-4 * want)
