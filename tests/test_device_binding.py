"""Device binding: a runtime bound to `cpu:2` runs `jax.exec` there and its outputs stay there.

JAX reads XLA_FLAGS once, so the multi-device checks run in a fresh process with four host CPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mpplug as mp
from mpplug.errors import ConfigError
from mpplug.kernels import KernelRuntime, invoke
from mpplug.kernels.devices import parse_device_spec

SCRIPT = textwrap.dedent(
    """
    import json
    import jax
    import jax.numpy as jnp
    import numpy as np
    import mpplug as mp
    from mpplug.errors import ConfigError
    from mpplug.kernels import KernelRuntime, invoke

    report = {"devices": len(jax.devices())}
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    pfunc, _, _ = mp.jax_export(lambda a, b: (a @ b.T, a.sum(), {"c": a * 2}), x, x)
    bound = KernelRuntime(device="cpu:2")

    def where(outs):
        return [sorted(d.id for d in o.devices()) for o in outs]

    outs = invoke(pfunc, x, x, runtime=bound)  # numpy inputs
    report["numpy"] = where(outs)
    report["values_ok"] = bool(np.allclose(np.asarray(outs[0]), x @ x.T))
    on_one = jax.device_put(x, jax.devices()[1])  # inputs committed to another device
    report["moved"] = where(invoke(pfunc, on_one, on_one, runtime=bound))
    report["inputs_stay"] = sorted(d.id for d in on_one.devices())
    chained = invoke(pfunc, outs[2], outs[2], runtime=bound)  # outputs feed the next call
    report["chained"] = where(chained)
    no_inputs, _, _ = mp.jax_export(lambda: jnp.arange(3))
    report["no_inputs"] = where(invoke(no_inputs, runtime=KernelRuntime(device="cpu:3")))
    wide = np.array([2**40 + 1], np.int64)
    pf64, _, _ = mp.jax_export(lambda a: a + 1, wide)
    out64 = invoke(pf64, wide, runtime=bound)[0]
    report["x64"] = [where([out64]), str(out64.dtype), int(out64[0])]
    report["default"] = where(invoke(pfunc, x, x, runtime=KernelRuntime()))
    report["by_device"] = where(
        invoke(pfunc, x, x, runtime=KernelRuntime(device=jax.devices()[1]))
    )
    try:
        invoke(pfunc, x, x, runtime=KernelRuntime(device="cpu:9"))
    except ConfigError as exc:
        report["cpu9"] = str(exc)
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report() -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    return result


def test_outputs_land_on_the_bound_device(report: dict[str, object]):
    assert report["numpy"] == [[2], [2], [2]]
    assert report["values_ok"] is True


def test_inputs_on_another_device_are_moved_and_left_where_they_were(report: dict[str, object]):
    assert report["moved"] == [[2], [2], [2]]
    assert report["inputs_stay"] == [1]


def test_outputs_feed_the_next_call_on_the_same_device(report: dict[str, object]):
    assert report["chained"] == [[2], [2], [2]]


def test_a_function_without_inputs_runs_on_the_bound_device(report: dict[str, object]):
    assert report["no_inputs"] == [[3]]


def test_64_bit_outputs_stay_64_bit_on_the_bound_device(report: dict[str, object]):
    assert report["x64"] == [[[2]], "int64", 2**40 + 2]


def test_an_unbound_runtime_uses_the_default_device(report: dict[str, object]):
    assert report["default"] == [[0], [0], [0]]


def test_a_runtime_can_be_bound_to_a_jax_device_object(report: dict[str, object]):
    assert report["by_device"] == [[1], [1], [1]]


def test_a_device_index_out_of_range_is_a_config_error(report: dict[str, object]):
    assert report["cpu9"] == "device 'cpu:9': only 4 cpu device(s) here (indices 0..3)"


# ---------------------------------------------------------------- in this process


@pytest.mark.parametrize("spec", ["gpu0", "cpu:", "cpu:-1", "cpu:a", "tpu:1:2", "", "metal:0"])
def test_a_malformed_device_spec_is_refused_when_the_runtime_is_made(spec: str):
    expected = f"device spec like 'cpu', 'cpu:1' or 'cuda:0', got {spec!r}"
    with pytest.raises(ConfigError, match=expected):
        KernelRuntime(device=spec)


@pytest.mark.parametrize(
    ("spec", "parsed"), [("cpu", ("cpu", 0)), ("cpu:3", ("cpu", 3)), ("cuda:1", ("cuda", 1))]
)
def test_device_specs_parse(spec: str, parsed: tuple[str, int]):
    assert parse_device_spec(spec) == parsed


def test_a_device_this_host_lacks_is_a_typed_error_at_first_use():
    import jax

    pfunc, _, _ = mp.jax_export(lambda a: a + 1, np.zeros(2, np.float32))
    missing = KernelRuntime(device=f"cpu:{len(jax.devices('cpu'))}")
    with pytest.raises(ConfigError, match=r"only \d+ cpu device"):
        invoke(pfunc, np.zeros(2, np.float32), runtime=missing)
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ConfigError, match="device 'cuda:0': no cuda backend here"):
            invoke(pfunc, np.zeros(2, np.float32), runtime=KernelRuntime(device="cuda:0"))
