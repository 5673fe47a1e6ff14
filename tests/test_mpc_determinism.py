"""A secure program traces to the same bytes every time: in one process and across processes
with different hash seeds (what an auditor compares, and what a cache keyed by digest needs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpplug as mp

ROOT = Path(__file__).resolve().parent.parent

PROGRAMS = r"""
import json, sys
import jax, jax.numpy as jnp
import numpy as np
import mpplug as mp


def sealed(fn, truncation="precise"):
    @mp.function
    def program(x, y):
        a, b = mp.mpc.seal((x, y), truncation=truncation)
        return mp.mpc.reveal(mp.mpc.run(fn, a, b), to=0)
    return program


def logistic_step(x, y):
    w = jnp.zeros((x.shape[1],), x.dtype)
    p = jax.nn.sigmoid(x @ w)
    return w - x.T @ (p - y) / x.shape[0]


cases = {
    "millionaire": (sealed(lambda a, b: a < b), np.int64, (8,), (8,)),
    "product": (sealed(lambda a, b: a * b), np.float64, (8,), (8,)),
    "product, probabilistic": (sealed(lambda a, b: a * b, "probabilistic"), np.float64, (8,), (8,)),
    "int64 order": (sealed(lambda a, b: (jnp.maximum(a, b), a == b)), np.int64, (8,), (8,)),
    "logistic step": (sealed(logistic_step), np.float32, (16, 4), (16,)),
}
out = {}
for name, (program, dtype, xs, ys) in cases.items():
    args = (mp.MPObject(np.zeros(xs, dtype), 0), mp.MPObject(np.zeros(ys, dtype), 1))
    compiled = mp.compile(program, *args, world_size=3)
    again = mp.compile(program, *args, world_size=3)
    out[name] = [compiled.digest, again.digest, compiled.ir()]
json.dump(out, sys.stdout)
"""


def _trace_in_processes(*hash_seeds: str) -> list[dict[str, list[str]]]:
    """The programs' digests and IR, traced in one process per hash seed, side by side."""
    running = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAMS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in hash_seeds
    ]
    results = []
    try:
        for process in running:
            out, err = process.communicate(timeout=300)
            assert process.returncode == 0, err[-3000:]
            results.append(json.loads(out))
    finally:
        for process in running:
            process.kill()
            process.wait()
    return results


@pytest.mark.slow
def test_secure_programs_trace_to_the_same_bytes_in_every_process():
    first, second = _trace_in_processes("1", "2")
    assert first.keys() == second.keys()
    for name in first:
        digest, again, ir = first[name]
        assert digest == again, f"{name}: two traces in one process differ"
        assert second[name][2] == ir, f"{name}: IR text differs across processes"
        assert second[name][0] == digest, f"{name}: digest differs across processes"
    digests = [first[name][0] for name in first]
    assert len(set(digests)) == len(digests), "distinct programs must not share a digest"


def test_the_truncation_choice_changes_the_program():
    @mp.function
    def program(x: object, y: object) -> object:
        a, b = mp.mpc.seal((x, y), truncation="probabilistic")
        return mp.mpc.run(lambda u, v: u * v, a, b)

    args = (mp.MPObject(np.zeros(3), 0), mp.MPObject(np.zeros(3), 1))
    ir = mp.compile(program, *args, world_size=3).ir()
    assert "trunc" in ir and "trunc.bits" not in ir
