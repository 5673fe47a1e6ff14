"""mp.mpc benchmark on the Simulator (3 parties, CPU): ABY3 over Z_2^64, 18 fraction bits, on
the workloads and data of the SPU 0.9.5 reference script (spu_bench.py); prints one markdown
table, and with `--spu spu.json` (that script's --json output) ratios and PASS/FAIL per target.

    python -m bench.mpc [--spu /tmp/spu.json ...] [--quick] [--only SUBSTRING] [--json out.json]
                        [--truncation precise|probabilistic|both]

Per workload, one program `reveal(run(fn, *seal(inputs)), to=0)`, input i held by party i % 3:
- first: `sim.compile` (jax trace + share program + export, "trace") plus the first
  evaluate+fetch (each round's PFunction planned at each party and run interpreted), in this
  one process: against an empty compile cache (a temporary folder, unless MPPLUG_CACHE_DIR is
  set), with JAX warmed by the workloads before it (`bench.mpc_start` times fresh processes).
- wall: median of 3 evaluate + fetch of the revealed result at party 0, after one warm-up;
  inputs are put beforehand (SPU's wall also counts turning numpy inputs into shares).
- rounds: SHUFFLE ops of the mpc.run part that move data (route with dst != src), then its
  depth (most such SHUFFLEs on one dependency chain; one round can send several messages),
  then all the program's SHUFFLE ops (with seal, key setup, reveal, and those that move
  nothing, e.g. seal's converge and reveal's own-pair step). The mpc.run part is
  found by tagging: SHUFFLEs fed by a CALL whose PFunction `rounds.record_rounds` named "mpc.*".
  A SHUFFLE in a loop's body counts once per iteration, and the loop's depth is its body's
  times its trip count: an `mp.fori_loop`'s from its bounds, another loop's (a sort's
  levels, which depend on the data's random order) from one profiled evaluation.
- bytes/party: for each moving route of those SHUFFLEs, the op's output nbytes, charged to the
  sender; mean and max over the 3 parties. Seal, key setup and reveal are excluded, as SPU's
  link counters exclude input sharing and output reconstruction.
- error vs numpy float64 on the same inputs, as the SPU script measures it: the median over
  this run's six evaluations (the first, the profiled one, the warm-up and the three timed
  ones, each with fresh randomness), and their range where they differ, where SPU's script
  gives one run's: given several runs of it (`--spu a.json b.json ...`), SPU's figures are
  their medians, and its errors' range is shown too (each run's error is one random draw).
Targets (with --spu): wall <= SPU wall, mean bytes per party <= SPU's, error <= SPU's (ours
rounded to the 3 significant digits SPU's JSON has). Exit code 1 when one is missed. The
targets hold on equal guarantees: they are checked on the default, precise truncation (SPU's
ABY3 default). `--truncation both` also runs every workload with `truncation="probabilistic"`
(each pair of timings taken in turns) and prints what precise truncation costs against it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mpplug as mp
import mpplug.mpc  # before any clock starts, as spu_bench imports spu (mp.mpc loads lazily)
from bench.timing import machine_state, numpy_huge_page_advice, samples
from mpplug.core.graph import OpKind
from mpplug.kernels.builtin import CONSTANT, COUNTER
from mpplug.kernels.compile_cache import ENV_DIR

REPEATS = 3
WARMUP = 1
RECV_TIMEOUT_S = 120.0
"""Per receive; the default 30 s can expire while a peer compiles on a loaded 2-core machine."""
ERROR_SLACK = 1.0
"""Error target: ours <= SPU's x this (1.0: no worse at all)."""
MPC_PREFIX = "mpc."
"""record_rounds names each round's PFunction mpc.<tags>."""


# ---------------------------------------------------------------- workloads (SPU's data)


def sigmoid_np(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def less(a: jax.Array, b: jax.Array) -> jax.Array:
    return a < b


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return a @ b


def mul(a: jax.Array, b: jax.Array) -> jax.Array:
    return a * b


def lr_step(x: jax.Array, y: jax.Array, w: jax.Array) -> jax.Array:
    p = jax.nn.sigmoid(x @ w)
    return w - 1.0 * (x.T @ (p - y)) / x.shape[0]


def index_table(t: jax.Array, i: jax.Array) -> jax.Array:
    return t[i]


def argmax_rows(a: jax.Array) -> jax.Array:
    return jnp.argmax(a, axis=1)


def reciprocal(a: jax.Array) -> jax.Array:
    return 1.0 / a


def lr_epochs_fori(x: jax.Array, y: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.fori_loop(0, 10, lambda i, w: lr_step(x, y, w), w)


def lr_np(x: np.ndarray, y: np.ndarray, w: np.ndarray, epochs: int) -> np.ndarray:
    for _ in range(epochs):
        w = w - 1.0 * (x.T @ (sigmoid_np(x @ w) - y)) / x.shape[0]
    return w


def mlp_loss(params: tuple[jax.Array, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    """SPU's: a ReLU hidden layer, softmax by hand, cross-entropy."""
    w1, w2 = params
    z = jax.nn.relu(x @ w1) @ w2
    e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    return -jnp.mean(jnp.sum(y * jnp.log(p + 1e-6), axis=-1))


def mlp_step(w1: jax.Array, w2: jax.Array, x: jax.Array, y: jax.Array) -> Any:
    g1, g2 = jax.grad(mlp_loss)((w1, w2), x, y)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def softmax_by_hand(z: jax.Array) -> jax.Array:
    e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


LENET_SHAPES = {
    "conv1": (6, 1, 5, 5),
    "conv2": (16, 6, 5, 5),
    "fc1": (256, 120),
    "fc2": (120, 84),
    "fc3": (84, 10),
}


def _conv_relu_pool(x: jax.Array, k: jax.Array) -> jax.Array:
    """SPU's LeNet block: a VALID stride-1 NCHW convolution, ReLU, 2x2 max-pool."""
    h = jax.lax.conv_general_dilated(
        x, k, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    h = jax.nn.relu(h)
    return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def lenet(
    c1: jax.Array, c2: jax.Array, f1: jax.Array, f2: jax.Array, f3: jax.Array, x: jax.Array
) -> jax.Array:
    """SPU's LeNet-5: 16x1x28x28 -> 6x12x12 -> 16x4x4 -> 120 -> 84 -> 10, softmax."""
    h = _conv_relu_pool(_conv_relu_pool(x, c1), c2)
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(jax.nn.relu(h @ f1) @ f2)
    return softmax_by_hand(h @ f3)


def lenet_step(*args: jax.Array) -> Any:
    """One SGD step (rate 0.1) of LeNet on cross-entropy: the five weights updated."""
    params, x, y = args[:5], args[5], args[6]

    def loss(p: tuple[jax.Array, ...]) -> jax.Array:
        return -jnp.mean(jnp.sum(y * jnp.log(lenet(*p, x) + 1e-6), axis=-1))

    grads = jax.grad(loss)(params)
    return tuple(w - 0.1 * g for w, g in zip(params, grads, strict=True))


def _flat(values: Any) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values])


@dataclass
class Workload:
    name: str
    """Exactly the SPU script's name, so that --spu rows match."""
    fn: Callable[..., Any]
    args: tuple[np.ndarray, ...]
    ref: np.ndarray
    metric: str
    """"wrong", "max abs" or "max rel"."""


def workloads(quick: bool) -> list[Workload]:
    """The SPU script's workloads (minus its unrolled 10-epoch logreg and those mp.mpc does
    not run yet), drawing from its generators in its order, so every input is bit for bit
    the one SPU ran on."""
    rng = np.random.default_rng(0)
    s = 10 if quick else 1
    out = []
    n = 100_000 // s
    x, y = rng.normal(size=n), rng.normal(size=n)
    out.append(Workload(f"x < y, n={n:,}", less, (x, y), x < y, "wrong"))
    for m in (128, 512):
        a, b = rng.normal(size=(m, m)), rng.normal(size=(m, m))
        out.append(Workload(f"matmul {m}x{m}", matmul, (a, b), a @ b, "max abs"))
    n = 1_000_000 // s
    x, y = rng.normal(size=n), rng.normal(size=n)
    out.append(Workload(f"mul, n={n:,}", mul, (x, y), x * y, "max abs"))
    X = rng.normal(size=(10_000, 16))
    w_true = rng.normal(size=16)
    labels = (rng.random(10_000) < sigmoid_np(X @ w_true)).astype(np.float64)
    w0 = np.zeros(16)
    p = sigmoid_np(X @ w0)
    ref = w0 - 1.0 * (X.T @ (p - labels)) / X.shape[0]
    out.append(Workload("logreg 1 epoch 10000x16", lr_step, (X, labels, w0), ref, "max abs"))
    ref10 = lr_np(X, labels, w0, 10)
    out.append(
        Workload(
            "logreg 10 epochs fori 10000x16", lr_epochs_fori, (X, labels, w0), ref10, "max abs"
        )
    )
    n = 100_000 // s
    xe = rng.uniform(-4, 4, n)
    out.append(Workload(f"exp, n={n:,}, x in [-4,4]", jnp.exp, (xe,), np.exp(xe), "max rel"))
    xr = rng.uniform(0.1, 10, n)
    out.append(
        Workload(f"reciprocal, n={n:,}, x in [0.1,10]", reciprocal, (xr,), 1.0 / xr, "max rel")
    )
    xs = rng.uniform(0.1, 100, n)
    out.append(Workload(f"sqrt, n={n:,}, x in [0.1,100]", jnp.sqrt, (xs,), np.sqrt(xs), "max rel"))
    mlp = np.random.default_rng(0)  # SPU's mlp_data(0), in its order
    xm = mlp.normal(size=(256, 64)).astype(np.float32)
    ym = np.eye(10, dtype=np.float32)[mlp.integers(0, 10, 256)]
    w1 = (mlp.normal(size=(64, 32)) * 0.1).astype(np.float32)
    w2 = (mlp.normal(size=(32, 10)) * 0.1).astype(np.float32)
    ref_mlp = np.concatenate(
        [np.ravel(np.asarray(v, np.float64)) for v in jax.jit(mlp_step)(w1, w2, xm, ym)]
    )
    out.append(Workload("mlp step 256x64-32-10", mlp_step, (w1, w2, xm, ym), ref_mlp, "max abs"))
    cnn = np.random.default_rng(1)  # SPU's lenet_data(1), in its order
    xc = cnn.random((16, 1, 28, 28)).astype(np.float32)
    weights = tuple(
        (cnn.normal(size=shape) * 0.1).astype(np.float32) for shape in LENET_SHAPES.values()
    )
    yc = np.eye(10, dtype=np.float32)[cnn.integers(0, 10, 16)]
    ref_infer = np.asarray(jax.jit(lenet)(*weights, xc), np.float64)
    out.append(Workload("cnn infer lenet 16x28x28", lenet, (*weights, xc), ref_infer, "max abs"))
    ref_step = _flat(jax.jit(lenet_step)(*weights, xc, yc))
    out.append(
        Workload(
            "cnn train step lenet 16x28x28", lenet_step, (*weights, xc, yc), ref_step, "max abs"
        )
    )
    for n, seed in ((10_000 // s, 2), (100_000 // s, 3)):
        xs = np.random.default_rng(seed).uniform(-100, 100, n).astype(np.float32)
        name = f"sort 1e{round(np.log10(n))}"
        out.append(Workload(name, jnp.sort, (xs,), np.sort(xs).astype(np.float64), "max abs"))
    xa = np.random.default_rng(4).normal(size=(10_000 // s, 10)).astype(np.float32)
    out.append(
        Workload(f"argmax {xa.shape[0]}x10", argmax_rows, (xa,), np.argmax(xa, axis=1), "wrong")
    )
    lookup = np.random.default_rng(5)
    table = lookup.normal(size=1000).astype(np.float32)
    idx = lookup.integers(0, 1000, 10_000 // s).astype(np.int32)
    name = f"secret index 1e{round(np.log10(idx.size))} of 1000"
    out.append(Workload(name, index_table, (table, idx), table[idx].astype(np.float64), "max abs"))
    return out


def error(metric: str, got: Any, ref: np.ndarray) -> float:
    if isinstance(got, tuple | list):  # a pytree of outputs: compared flat, in order
        got = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in got])
    if metric == "wrong":  # bools (x < y) or indices (argmax), element by element
        return float(np.sum(np.asarray(got) != np.asarray(ref)))
    diff = np.abs(np.asarray(got, np.float64) - ref)
    if metric == "max rel":
        diff = diff / np.abs(ref)
    return float(np.max(diff))


def program(fn: Callable[..., Any], arity: int, truncation: str) -> mp.MPFunction:
    """reveal(run(fn, *seal(args)), to=0) as a fresh program (the cluster caches per function)."""

    def secure(*args: mp.MPObject) -> mp.MPObject:
        if len(args) != arity:
            raise TypeError(f"expected {arity} arguments, got {len(args)}")
        sealed = [mp.mpc.seal(a, truncation=truncation) for a in args]
        return mp.mpc.reveal(mp.mpc.run(fn, *sealed), to=0)

    return mp.function(secure)


# ---------------------------------------------------------------- program statistics


@dataclass
class Comm:
    shuffles: int = 0
    """SHUFFLE ops of the mpc.run part that move data."""
    depth: int = 0
    total_shuffles: int = 0
    bytes_sent: dict[int, int] = field(default_factory=dict)
    """mpc.run part, per sending party."""
    total_bytes_sent: dict[int, int] = field(default_factory=dict)


def comm_stats(graph: Any, parties: int, runs: dict[int, int] | None = None) -> Comm:
    """Rounds and bytes of a compiled program's Graph (see the module docstring); `runs`:
    the trip counts of its top-level loops in one evaluation (`loop_trips`), for loops that
    are not `mp.fori_loop`s."""
    comm = Comm(
        bytes_sent=dict.fromkeys(range(parties), 0),
        total_bytes_sent=dict.fromkeys(range(parties), 0),
    )
    comm.depth = _block_stats(graph, graph, comm, 1, {}, runs or {})
    return comm


def loop_trips(sim: Any, once: Callable[[], Any]) -> dict[int, int]:
    """How many iterations each top-level loop of the evaluation `once()` makes runs at party
    0, by loop op id (its body's ops run in scope (loop, 1, iteration))."""
    with sim.profile() as timeline:
        once()
    seen: dict[int, set[int]] = {}
    for span in timeline.spans:
        scope = span.args.get("scope", ())
        if span.party == 0 and span.category == "op" and len(scope) >= 3 and scope[1] == 1:
            seen.setdefault(scope[0], set()).add(scope[2])
    return {loop: len(iterations) for loop, iterations in seen.items()}


def _block_stats(
    graph: Any, block: Any, comm: Comm, times: int, start: dict[Any, int], runs: dict[int, int]
) -> int:
    """Adds `block`'s SHUFFLEs, run `times` times, to `comm`; returns its depth, counted from
    `start` (the depth of each of its inputs, by the op that makes it)."""
    depth: dict[int, int] = {}
    by_id = {o.id: o for o in block.ops}
    for op in block.ops:
        deepest = max((depth.get(ref.op, 0) for ref in op.inputs), default=0)
        if op.kind is OpKind.INPUT:
            deepest = start.get(op.input_index, 0)
        depth[op.id] = deepest
        if op.kind is OpKind.WHILE:
            body = op.regions[1]
            trips = _trips(graph, block, op, runs)
            inner = _block_stats(graph, body, comm, times * trips, {}, runs)
            depth[op.id] = deepest + inner * trips
            continue
        if op.kind is not OpKind.SHUFFLE:
            continue
        comm.total_shuffles += times
        moving = [(dst, src) for dst, src in op.routes if dst != src]
        nbytes = op.outs[0].nbytes * times
        for _, src in moving:
            comm.total_bytes_sent[src] += nbytes
        feeder = by_id.get(op.inputs[0].op) if op.inputs else None
        in_mpc = (
            feeder is not None
            and feeder.kind is OpKind.CALL
            and graph.functions[feeder.function].fn_name.startswith(MPC_PREFIX)
        )
        if in_mpc and moving:
            comm.shuffles += times
            depth[op.id] = deepest + 1
            for _, src in moving:
                comm.bytes_sent[src] += nbytes
    return max(depth.values(), default=0)


def _trips(graph: Any, block: Any, loop: Any, runs: dict[int, int]) -> int:
    """The trip count of an `mp.fori_loop` (its constant start and its counter's stop), or
    of another top-level loop (a sort's levels) as `runs` counted it."""
    ops = {o.id: o for o in block.ops}
    first = ops.get(loop.inputs[0].op)
    stops = [
        graph.functions[o.function].attrs["stop"]
        for o in loop.regions[1].ops
        if o.kind is OpKind.CALL and graph.functions[o.function].fn_type == COUNTER
    ]
    if first is None or first.kind is not OpKind.CALL or len(stops) != 1:
        if block is not graph or loop.id not in runs:
            raise ValueError(
                f"bench.mpc counts other loops only at the top level, got {loop.label}"
            )
        return runs[loop.id]
    pfunc = graph.functions[first.function]
    if pfunc.fn_type != CONSTANT:
        raise ValueError(f"bench.mpc counts only loops with a constant start, got {loop.label}")
    lower = int(np.frombuffer(pfunc.fn_body, np.int32)[0])
    return max(int(stops[0]) - lower, 0)


# ---------------------------------------------------------------- running


@dataclass
class Result:
    name: str
    truncation: str
    trace_s: float
    first_s: float
    wall_s: float
    walls: list[float]
    comm: Comm
    error: float
    """The median over the run's evaluations (the protocol's randomness moves it)."""
    errors: list[float]
    """Each evaluation's, in order."""
    metric: str


def run_workload(sim: Any, w: Workload, truncations: tuple[str, ...]) -> list[Result]:
    """One Result per truncation; the timed calls of the truncations take turns."""
    handles = [sim.put(i % 3, a) for i, a in enumerate(w.args)]
    calls, firsts, runs = {}, {}, {}
    outputs: dict[str, list[Any]] = {t: [] for t in truncations}
    for truncation in truncations:
        prog = program(w.fn, len(w.args), truncation)

        def once(prog: mp.MPFunction = prog, kept: list[Any] = outputs[truncation]) -> Any:
            got = sim.fetch(sim.evaluate(prog, *handles), party=0)
            kept.append(got)
            return got

        start = time.perf_counter()
        compiled = sim.compile(prog, *handles)
        trace = time.perf_counter() - start
        once()
        firsts[truncation] = (trace, time.perf_counter() - start, compiled)
        calls[truncation] = once
        runs[truncation] = loop_trips(sim, once)
    walls: dict[str, list[float]] = {t: [] for t in truncations}
    for _ in range(WARMUP):
        for once in calls.values():
            once()
    for _ in range(REPEATS):
        for truncation, once in calls.items():
            walls[truncation] += samples(once, 1)
    errors = {t: [error(w.metric, got, w.ref) for got in outputs[t]] for t in truncations}
    results = []
    for truncation in truncations:
        trace, first, compiled = firsts[truncation]
        results.append(
            Result(
                w.name,
                truncation,
                trace,
                first,
                statistics.median(walls[truncation]),
                walls[truncation],
                comm_stats(compiled.graph, sim.world_size, runs[truncation]),
                statistics.median(errors[truncation]),
                errors[truncation],
                w.metric,
            )
        )
    return results


# ---------------------------------------------------------------- SPU comparison


SPU_MEDIANS = ("wall_median_s", "first_s", "error_value", "send_bytes_mean")
"""The figures of the SPU anchor's rows that several runs of it are merged by: their medians."""


def load_spu(paths: Sequence[str], need_wall: bool = True) -> dict[str, dict[str, Any]]:
    """The SPU script's ABY3 rows by workload name, with its error string parsed; without
    `need_wall`, also the rows whose first call ran but took too long to be repeated. From
    several runs of the script (one file each), each workload's row holds the median of each
    of `SPU_MEDIANS` over the runs that measured it, and `error_values` every run's error:
    SPU's error is one random draw per run, as each of our evaluations' is."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            measured = row.get("wall_median_s" if need_wall else "first_s")
            if row.get("protocol") != "ABY3" or measured is None:
                continue
            text = row["error"]
            m = re.search(r"(\d+) wrong", text) or re.search(
                r"max (?:abs|rel) ([0-9.]+(?:e[+-]?\d+)?)", text
            )
            row["error_value"] = float(m.group(1)) if m else None
            runs.setdefault(row["workload"], []).append(row)
    merged = {}
    for name, rows in runs.items():
        row = dict(rows[0])
        for key in SPU_MEDIANS:
            values = [r[key] for r in rows if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["error_values"] = [r["error_value"] for r in rows if r["error_value"] is not None]
        merged[name] = row
    return merged


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB"):
        if b < 1024:
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GiB"


def fmt_error(metric: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{int(value)} wrong" if metric == "wrong" else f"{metric} {value:.2e}"


def fmt_errors(r: Result) -> str:
    """The median error, and the range of the run's evaluations where they differ."""
    return fmt_spread(r.metric, r.error, r.errors)


def fmt_spread(metric: str, median: float | None, values: Sequence[float]) -> str:
    """`median` as an error, and the range of `values` beside it where they differ."""
    if median is None or not values or min(values) == max(values):
        return fmt_error(metric, median)
    low, high = min(values), max(values)
    spread = f"{int(low)}-{int(high)}" if metric == "wrong" else f"{low:.2e}-{high:.2e}"
    return f"{fmt_error(metric, median)} ({spread} over {len(values)})"


def mean_bytes(r: Result) -> float:
    sent = list(r.comm.bytes_sent.values())
    return sum(sent) / len(sent)


def truncation_cost(results: list[Result]) -> str:
    """What precise truncation costs against probabilistic, per workload: ratios of rounds,
    mean bytes per party and wall, and both errors."""
    by = {(r.name, r.truncation): r for r in results}
    head = [
        "workload",
        "rounds precise / probabilistic",
        "bytes/party precise / probabilistic",
        "wall s precise / probabilistic",
        "error precise",
        "error probabilistic",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(r.name for r in results):
        p, q = by.get((name, "precise")), by.get((name, "probabilistic"))
        if p is None or q is None:
            continue
        cells = [
            name,
            f"{p.comm.depth} / {q.comm.depth} ({p.comm.depth / max(q.comm.depth, 1):.2f}x)",
            f"{fmt_bytes(mean_bytes(p))} / {fmt_bytes(mean_bytes(q))} "
            f"({mean_bytes(p) / max(mean_bytes(q), 1):.2f}x)",
            f"{p.wall_s:.3f} / {q.wall_s:.3f} ({p.wall_s / q.wall_s:.2f}x)",
            fmt_error(p.metric, p.error),
            fmt_error(q.metric, q.error),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: list[Result], spu: dict[str, dict[str, Any]] | None) -> tuple[str, bool]:
    head = [
        "workload",
        "first s (trace)",
        "wall s",
        "rounds run/depth/total",
        "bytes/party mean (max)",
        "error vs numpy",
    ]
    if spu is not None:
        head += [
            "SPU wall s",
            "wall ratio",
            "SPU bytes/party",
            "bytes ratio",
            "SPU sends",
            "SPU error",
            "target",
        ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missed = False
    for r in results:
        if r.truncation != "precise":
            continue
        sent = list(r.comm.bytes_sent.values())
        mean_b = mean_bytes(r)
        cells = [
            r.name,
            f"{r.first_s:.2f} ({r.trace_s:.2f})",
            f"{r.wall_s:.3f}",
            f"{r.comm.shuffles}/{r.comm.depth}/{r.comm.total_shuffles}",
            f"{fmt_bytes(mean_b)} ({fmt_bytes(max(sent))})",
            fmt_errors(r),
        ]
        if spu is not None:
            row = spu.get(r.name)
            if row is None:
                cells += ["n/a"] * 6 + ["no SPU row"]
            else:
                wall_ratio = r.wall_s / row["wall_median_s"]
                spu_b = row.get("send_bytes_mean")
                bytes_ratio = mean_b / spu_b if spu_b else None
                spu_err = row["error_value"]
                misses = []
                if wall_ratio > 1.0:
                    misses.append("wall")
                if bytes_ratio is None or bytes_ratio > 1.0:
                    misses.append("bytes")
                # SPU's JSON gives its error to 3 significant digits: compare ours at that
                if spu_err is None or float(f"{r.error:.2e}") > spu_err * ERROR_SLACK:
                    misses.append("error")
                missed |= bool(misses)
                cells += [
                    f"{row['wall_median_s']:.3f}",
                    f"{wall_ratio:.2f}",
                    fmt_bytes(spu_b),
                    "n/a" if bytes_ratio is None else f"{bytes_ratio:.2f}",
                    str(row.get("send_actions_max", "n/a")),
                    fmt_spread(r.metric, spu_err, row["error_values"]),
                    "PASS" if not misses else "FAIL (" + ", ".join(misses) + ")",
                ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--spu",
        nargs="+",
        help="the SPU anchor's --json output, for ratios and targets (several runs: medians)",
    )
    ap.add_argument("--quick", action="store_true", help="10x smaller vectors (as SPU's --quick)")
    ap.add_argument("--only", help="substring filter on workload names")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument(
        "--truncation",
        choices=("precise", "probabilistic", "both"),
        default="precise",
        help="precise (the default, as SPU's) is what the targets check",
    )
    args = ap.parse_args()
    truncations = ("precise", "probabilistic") if args.truncation == "both" else (args.truncation,)
    spu = load_spu(args.spu) if args.spu else None
    print(
        f"mpplug {mp.__version__} mp.mpc benchmark: Simulator(3), ABY3 Z_2^64, 18 fraction bits; "
        f"jax {jax.__version__} ({jax.devices()[0].platform}), numpy {np.__version__}, "
        f"python {platform.python_version()}, {os.cpu_count()} cores, {machine_state()}, "
        f"NumPy huge pages {numpy_huge_page_advice()}",
        flush=True,
    )
    chosen = [w for w in workloads(args.quick) if not args.only or args.only in w.name]
    results = []
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if ENV_DIR not in os.environ:  # first runs as a user's first: nothing cached
            os.environ[ENV_DIR] = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="mpplug-bench-cache-")
            )
            stack.callback(os.environ.pop, ENV_DIR, None)
        print(f"  compile cache: {os.environ[ENV_DIR] or 'off'}", flush=True)
        sim = stack.enter_context(mp.Simulator(3, timeout=RECV_TIMEOUT_S))
        for w in chosen:
            for r in run_workload(sim, w, truncations):
                results.append(r)
                print(
                    f"  {r.name} ({r.truncation}): first {r.first_s:.2f} s, wall {r.wall_s:.3f} s "
                    f"{[round(t, 3) for t in r.walls]}, depth {r.comm.depth}, {fmt_errors(r)}",
                    flush=True,
                )
    print(f"  ({time.perf_counter() - start:.0f} s in all)\n")
    text, missed = table(results, spu)
    print(text)
    if len(truncations) == 2:
        print("\nWhat precise truncation costs (each pair timed in turns):\n")
        print(truncation_cost(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if spu is not None and missed else 0


if __name__ == "__main__":
    sys.exit(main())
