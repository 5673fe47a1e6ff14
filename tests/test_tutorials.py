"""Every tutorial runs to completion as a newcomer would run it (`python tutorials/X.py`).

The quickstart must also give the right answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("[0-9][0-9]_*.py"))


def test_the_tutorials_exist():
    assert [t.name[:2] for t in TUTORIALS][:3] == ["00", "01", "02"]


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
