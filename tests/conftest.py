"""Shared fixtures: the `make_cluster` factory over every cluster kind, and the test plugin.

The plugin folder goes on sys.path so its kernels are found through entry points. Tests
marked `slow` run first, so that pytest-xdist workers start the long ones while the short
ones are left to fill in around them (pyproject's `--dist worksteal` lets an idle worker
take short ones queued at a busy one). Ports come from each worker's own block (`ports`).
The session starts by compiling mpplug's sources to bytecode, so the party and CLI processes
the tests start read it even where PYTHONDONTWRITEBYTECODE keeps Python from writing it.
"""

from __future__ import annotations

import compileall
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import mpplug.config
from mpplug import Cluster

from .clusters import KINDS, PLUGIN_DIR, POOL
from .ports import WorkerPorts

if str(PLUGIN_DIR) not in sys.path:  # the test plugin is found through its entry points
    sys.path.insert(0, str(PLUGIN_DIR))

DEFAULT_TIMEOUT = 20.0

mpplug.config.free_ports = WorkerPorts().take  # type: ignore[assignment]
"""Clusters the tests make listen on this worker's own ports (see `ports`)."""


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # once, in the process that starts the workers
        root = Path(__file__).resolve().parent.parent
        for package in ("mpplug", "simulator"):
            compileall.compile_dir(root / package, quiet=1)


def pytest_runtest_logfinish() -> None:
    """What outlives a test (the caches of plans, traces and executables: millions of objects
    by the end of a worker's session) is moved out of the collector's reach after it, so each
    full collection scans only what later tests make, and the worker's exit does not scan it
    all once more. Garbage is collected first, so only live objects are frozen."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: order kept


@pytest.fixture(scope="session", autouse=True)
def _stop_pooled_parties() -> Iterator[None]:
    """Party processes pooled by the "driver" kind are stopped when the session ends."""
    yield
    POOL.close()


@pytest.fixture(params=sorted(KINDS))
def cluster_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_cluster(cluster_kind: str) -> Iterator[Callable[..., Cluster]]:
    """`make_cluster(world_size, timeout=...)`: a cluster of the parametrized kind, closed
    at teardown even when the test fails."""
    with contextlib.ExitStack() as stack:

        def make(world_size: int, timeout: float = DEFAULT_TIMEOUT) -> Cluster:
            return stack.enter_context(KINDS[cluster_kind](world_size, timeout))

        yield make
