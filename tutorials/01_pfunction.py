"""Tutorial 1: a PFunction, the portable unit of work every party runs.

Export a JAX function, look inside the PFunction it becomes, turn it into bytes (what travels
to the parties) and back, and run it through the `jax.exec` kernel, here and on a bound device.
"""

from __future__ import annotations

import os
from typing import Any

# Pretend this host has four CPU devices, so that section 7 can bind a runtime to "cpu:2".
# JAX reads XLA_FLAGS once, when its backend starts, so this must come before using JAX.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np

import mpplug as mp
from mpplug.kernels import REGISTRY, KernelRuntime, invoke

Array = np.ndarray | jax.Array


def score(features: Array, weights: Array, *, bias: float, activation: str) -> Any:
    """A tiny model: a matrix product, an activation chosen at export time, and a summary."""
    logits = features @ weights + bias
    act = jnp.tanh if activation == "tanh" else jax.nn.relu
    out = act(logits)
    return {"out": out, "stats": (out.mean(), out.max())}


def main() -> None:
    features = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    weights = np.ones((4, 2), np.float32)

    # 1. Export. Arrays become runtime inputs; `bias` and `activation` are plain Python values,
    #    so they are baked into the function as constants.
    pfunc, in_vars, out_tree = mp.jax_export(score, features, weights, bias=0.5, activation="tanh")
    print("== 1. export")
    print(pfunc)
    print(f"runtime inputs: {len(in_vars)} (the two arrays; bias and activation are baked in)")
    print(f"output tree:    {out_tree}")

    # 2. Look inside. The body is the raw `jax.export` artifact; attrs say how it was made.
    print("\n== 2. the record")
    print(f"fn_type   {pfunc.fn_type!r}  (the kernel that runs it)")
    print(f"fn_name   {pfunc.fn_name!r}")
    print(f"ins_info  {', '.join(map(str, pfunc.ins_info))}")
    print(f"outs_info {', '.join(map(str, pfunc.outs_info))}")
    print(f"fn_body   {len(pfunc.fn_body)} bytes of serialized StableHLO and metadata")
    for key, value in pfunc.attrs.items():
        print(f"attr      {key} = {value!r}")
    print(f"digest    {pfunc.digest}")

    # 3. Bytes. This is what a party receives; decoding gives an equal record, same digest.
    print("\n== 3. to bytes and back")
    data = pfunc.to_bytes()
    again = mp.PFunction.from_bytes(data)
    print(
        f"{len(data)} bytes; equal after the round trip: {again == pfunc}; "
        f"same digest: {again.digest == pfunc.digest}"
    )
    twice = mp.jax_export(score, features, weights, bias=0.5, activation="tanh")[0]
    print(f"exporting again gives the same digest: {twice.digest == pfunc.digest}")

    # 4. Run. `invoke` checks the arguments against ins_info, finds the kernel registered for
    #    fn_type (jax.exec, found through its entry point) and returns the flat outputs.
    print("\n== 4. run through jax.exec")
    print(f"kernel for 'jax.exec': {REGISTRY.lookup('jax.exec').__module__}")
    runtime = KernelRuntime()  # one party's state: device and a cache of loaded bodies
    flat = invoke(again, features, weights, runtime=runtime)
    result = jax.tree.unflatten(out_tree, flat)
    expected = score(features, weights, bias=0.5, activation="tanh")
    print(f"out =\n{np.asarray(result['out'])}")
    print(f"stats (mean, max) = ({float(result['stats'][0]):.4f}, {float(result['stats'][1]):.4f})")
    print(
        f"matches calling the function directly: "
        f"{np.allclose(np.asarray(result['out']), np.asarray(expected['out']))}"
    )

    # The second call reuses the loaded body: the runtime caches it by digest.
    invoke(again, features * 2, weights, runtime=runtime)
    print(f"bodies loaded by this runtime: {len(runtime.cache('jax.exec'))}")

    # 5. Arguments are checked before anything runs.
    print("\n== 5. a wrong argument")
    try:
        invoke(pfunc, features.astype(np.float64), weights, runtime=runtime)
    except mp.ArgumentMismatchError as exc:
        print(f"ArgumentMismatchError: {exc}")

    # 6. 64-bit types are kept even though this process never enabled jax_enable_x64.
    print("\n== 6. 64-bit stays 64-bit")
    big = np.array([2**40 + 1], np.int64)
    pf64, _, _ = mp.jax_export(lambda a: a * 3, big)
    (tripled,) = invoke(pf64, big)
    print(
        f"{pf64.ins_info[0]} -> {pf64.outs_info[0]}: {int(tripled[0])} "
        f"(exact: {int(tripled[0]) == 3 * (2**40 + 1)}); "
        f"jax_enable_x64 still {jax.config.read('jax_enable_x64')}"
    )

    # 7. A runtime can be bound to a device ("cpu:1", "cuda:0"); outputs stay on it.
    print("\n== 7. device binding")
    spec = "cpu:2" if len(jax.devices("cpu")) > 2 else "cpu:0"
    bound = KernelRuntime(device=spec)
    on_device = invoke(pfunc, features, weights, runtime=bound)[0]
    print(
        f"{len(jax.devices('cpu'))} CPU devices; bound to {spec!r}; "
        f"the output lives on {sorted(d.id for d in on_device.devices())}"
    )
    try:
        KernelRuntime(device="gpu0")
    except mp.MPPlugError as exc:
        print(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
