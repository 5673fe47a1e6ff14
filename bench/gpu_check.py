"""GPU check for custom calls: a party bound to `cuda:0` beside a CPU party runs JAX's linear
algebra, FFT, sort and random numbers, on the Simulator and on real party servers (which check
every native call's buffers), under the default custom-call policy.

    python -m bench.gpu_check

Prints, per function, the custom-call targets its cuda export calls (each must be admitted by
the default policy and pass the buffer check) and the largest difference between the GPU
party's result and the CPU party's; exits 1 on any failure. Needs a CUDA JAX.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import yaml

import mpplug as mp
from mpplug import ClusterSpec
from mpplug.core.custom_calls import DEFAULT_POLICY, check_buffers
from mpplug.kernels.module_check import ModuleChecker
from mpplug.remote.server import PartyServer

rng = np.random.default_rng(3)
A = rng.normal(size=(6, 6)).astype(np.float32)
SPD = (A @ A.T + 6 * np.eye(6)).astype(np.float32)
B = rng.normal(size=(6, 2)).astype(np.float32)
KEY = np.array([1, 2], np.uint32)

FUNCTIONS: dict[str, Any] = {
    "cholesky": lambda spd, a, b, k: jnp.linalg.cholesky(spd),
    "qr_r_abs": lambda spd, a, b, k: jnp.abs(jnp.linalg.qr(a)[1]),
    "svd_values": lambda spd, a, b, k: jnp.linalg.svd(a, compute_uv=False),
    "eigh_values": lambda spd, a, b, k: jnp.linalg.eigh(spd)[0],
    "solve": lambda spd, a, b, k: jnp.linalg.solve(a, b),
    "inv": lambda spd, a, b, k: jnp.linalg.inv(spd),
    "det": lambda spd, a, b, k: jnp.linalg.det(spd) / 1e6,
    "triangular_solve": lambda spd, a, b, k: jsl.solve_triangular(
        jnp.linalg.cholesky(spd), b, lower=True
    ),
    "fft_abs": lambda spd, a, b, k: jnp.abs(jnp.fft.fft(a[0])),
    "sort": lambda spd, a, b, k: jnp.sort(a[0]),
    "normal": lambda spd, a, b, k: jax.random.normal(jax.random.wrap_key_data(k), (8,)),
    "uniform": lambda spd, a, b, k: jax.random.uniform(jax.random.wrap_key_data(k), (8,)),
    "permutation": lambda spd, a, b, k: jax.random.permutation(jax.random.wrap_key_data(k), 8),
}


def cuda_targets(checker: ModuleChecker) -> dict[str, tuple[str, ...]]:
    """Each function's cuda export: its custom calls, checked as a party server checks them."""
    specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in (SPD, A, B, KEY)]
    found = {}
    for name, fn in FUNCTIONS.items():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*specs)
        calls = checker.check(exported.mlir_module_serialized, with_sdy=True).custom_calls
        DEFAULT_POLICY.check([c.target for c in calls], "cuda", name)
        for call in calls:
            check_buffers(call, name)
        found[name] = tuple(sorted({c.target for c in calls}))
    return found


@mp.function
def both(spd: Any, a: Any, b: Any, k: Any) -> Any:
    """Every function at party 0 (the GPU) and at party 1 (the CPU)."""
    args = [mp.bcast(0, v) for v in (spd, a, b, k)]
    return tuple(
        (mp.run_jax_at(0, fn, *args), mp.run_jax_at(1, fn, *args)) for fn in FUNCTIONS.values()
    )


def compare(cluster: mp.Cluster, label: str) -> bool:
    handles = [cluster.put(0, v) for v in (SPD, A, B, KEY)]
    results = cluster.evaluate(both, *handles)
    ok = True
    for name, (gpu, cpu) in zip(FUNCTIONS, results, strict=True):
        g, c = np.asarray(cluster.fetch(gpu, party=0)), np.asarray(cluster.fetch(cpu, party=1))
        exact = name in ("sort", "normal", "uniform", "permutation")
        diff = float(np.max(np.abs(g.astype(np.float64) - c.astype(np.float64))))
        good = diff == 0.0 if name == "permutation" else diff <= (1e-6 if exact else 1e-3)
        ok &= good
        print(f"  {label:10} {name:17} max |gpu - cpu| = {diff:.2e}  {'ok' if good else 'FAIL'}")
    return ok


def main() -> int:
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    if not any(d.platform == "gpu" for d in jax.devices()):
        print("no CUDA device: nothing to check")
        return 1
    checker = ModuleChecker()
    try:
        for name, targets in cuda_targets(checker).items():
            print(f"  cuda export  {name:17} custom calls {list(targets)}: admitted, buffers ok")
    finally:
        checker.close()
    ok = True
    with mp.Simulator(2, devices=["cuda:0", "cpu"]) as sim:
        ok &= compare(sim, "Simulator")
    spec = ClusterSpec.local(2)
    data = spec.to_dict()
    data["parties"][0]["device"], data["parties"][1]["device"] = "cuda:0", "cpu"
    spec = ClusterSpec.from_dict(data, source="gpu_check")
    servers = [PartyServer(spec, name) for name in spec.names]
    for server in servers:
        server.start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            config = Path(folder) / "cluster.yaml"
            config.write_text(yaml.safe_dump(spec.to_dict()))
            with mp.Driver(config, timeout=120.0) as driver:
                ok &= compare(driver, "Driver")
    finally:
        for server in servers:
            server.stop(0.0)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
