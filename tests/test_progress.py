"""Progress lines of long work on the `mpplug` logger: a secure function's trace says how many
of its equations it has interpreted and how many of its rounds it has written, at most once
a second, and nothing when it is quick."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import numpy as np
import pytest

import mpplug as mp
from mpplug.core import progress

X = np.linspace(-2, 2, 8, dtype=np.float32)
Y = np.linspace(0.5, 3, 8, dtype=np.float32)


@mp.function
def compare_and_scale(x: Any, y: Any) -> Any:
    a, b = mp.mpc.seal(x, [0, 1, 2]), mp.mpc.seal(y, [0, 1, 2])
    out = mp.mpc.run(lambda a, b: (a * b + 1.0, a < b), a, b)
    return mp.mpc.reveal(out, to=0)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mpplug"]


def _counts(lines: list[str], verb: str, unit: str) -> tuple[list[int], int | None]:
    """The `done` of each "verb done of total unit" line, and the total of the last line."""
    done = [int(m.group(1)) for ln in lines if (m := re.search(rf"{verb} (\d+) of \d+ {unit}", ln))]
    last = [int(m.group(1)) for ln in lines if (m := re.search(rf"{verb} (\d+) {unit} \(", ln))]
    return done, (last[-1] if last else None)


def test_a_long_trace_logs_the_equations_it_interpreted_and_the_rounds_it_wrote(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")  # traced here, not found on disk
    with caplog.at_level(logging.INFO, logger="mpplug"), mp.Simulator(3) as sim:
        x, y = sim.put(0, X), sim.put(1, Y)
        monkeypatch.setattr(progress, "EVERY_S", 0.0)  # every step is "long": each one logs
        sim.compile(compare_and_scale, x, y)
        monkeypatch.setattr(progress, "EVERY_S", 1.0)
        got = sim.fetch(sim.evaluate(compare_and_scale, x, y), party=0)
    np.testing.assert_allclose(got[0], X * Y + 1, atol=1e-4)
    np.testing.assert_array_equal(got[1], X < Y)
    lines = [ln for ln in _lines(caplog) if ln.startswith("mp.mpc.run(lambda): ")]
    equations, interpreted = _counts(lines, "interpreted", "equations")
    rounds, wrote = _counts(lines, "wrote", "rounds")
    assert interpreted is not None and interpreted > 2, lines
    assert equations == list(range(1, interpreted + 1)), lines  # one line a step, in order
    assert wrote is not None and wrote > 2, lines
    assert rounds == list(range(1, wrote)), lines
    assert all(re.search(r"\(\d+\.\d s\)$", ln) for ln in lines), lines


def test_a_quick_trace_logs_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")
    monkeypatch.setattr(progress, "EVERY_S", 60.0)
    with caplog.at_level(logging.INFO, logger="mpplug"), mp.Simulator(3) as sim:
        sim.fetch(sim.evaluate(compare_and_scale, sim.put(0, X), sim.put(1, Y)), party=0)
    assert not [ln for ln in _lines(caplog) if "mp.mpc.run" in ln]


def test_steps_log_at_most_once_an_interval_and_a_last_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    with caplog.at_level(logging.INFO, logger="mpplug"):
        steps = progress.Steps("work", "did", 1_000_000, "things")
        start, done = time.monotonic(), 0
        while time.monotonic() - start < 0.4:
            done += 1
            steps.step(done)
        steps.end()
    lines = [ln for ln in _lines(caplog) if ln.startswith("work: ")]
    assert 3 <= len(lines) <= 0.4 / 0.05 + 2, lines  # none in the first 0.05 s, then <= 1 each
    assert lines[-1].startswith("work: did 1000000 things ("), lines
    assert all(re.match(r"work: did \d+ of 1000000 things \(\d\.\d s\)$", ln) for ln in lines[:-1])
