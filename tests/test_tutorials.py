"""Every tutorial runs to completion as a newcomer would run it (`python tutorials/X.py`).

The quickstart must also give the right answer. Tutorial 07's pipeline (which runs on the
Simulator as a script) also runs on three real party processes started from its cluster file.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mpplug.config import ClusterSpec
from mpplug.remote.launch import LocalParties

from .clusters import PARTY_ENV, driven

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("[0-9][0-9]_*.py"))


def test_the_tutorials_exist():
    assert [t.name[:2] for t in TUTORIALS][:3] == ["00", "01", "02"]


@pytest.mark.slow
@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs(tutorial: Path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, str(tutorial)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tutorial.parent.parent,
    )
    assert done.returncode == 0, f"{tutorial.name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{tutorial.name} printed nothing"
    if tutorial.name == "00_quickstart.py":
        assert "Is Bob richer than Alice? True" in done.stdout


def test_the_quickstart_describes_the_program_it_runs():
    import ast

    import mpplug.demo

    quickstart = TUTORIALS[0]
    text = ast.get_docstring(ast.parse(quickstart.read_text())) or ""
    demo = mpplug.demo.__doc__ or ""
    for fact in ("three simulated parties", "secret-shared", "Carol", "mp.mpc"):
        assert fact in text.replace("\n", " "), fact
        assert fact.split()[0] in demo, fact
    assert "two simulated parties" not in text and "compares them at Alice" not in text


def _tutorial_module(stem: str) -> ModuleType:
    """A tutorial imported as a module (its file name starts with a digit)."""
    (path,) = [t for t in TUTORIALS if t.stem == stem]
    spec = importlib.util.spec_from_file_location(f"tutorial_{stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tutorial_07_vertical_pipeline_on_real_parties(tmp_path: Path):
    """PSI, SQL and secure training from the tutorial's CSV files on three party processes:
    the secure model is within a point of plaintext training on the true join, and Alice and
    Bob (only) wrote it."""
    pipeline = _tutorial_module("07_vertical_pipeline")
    config = pipeline.write_data(tmp_path)
    spec = ClusterSpec.from_yaml(config)
    with LocalParties(config, log_dir=tmp_path / "logs", env=PARTY_ENV, fork=True) as parties:
        parties.start()
        parties.wait_ready(timeout=120.0)
        with driven(parties, 60.0) as driver:
            model = pipeline.run_pipeline(driver)
    assert model["w"].shape == (16,) and model["b"].shape == (1,)
    secure, plain = pipeline.judge(spec, model)  # also checks model.csv at Alice and Bob
    assert abs(secure - plain) <= pipeline.TOLERANCE and plain > 0.8
    written = {
        p.name: sorted(f.name for f in p.outputs.path.iterdir()) for p in spec.parties if p.outputs
    }
    assert written == {"alice": ["model.csv"], "bob": ["model.csv"], "carol": []}
