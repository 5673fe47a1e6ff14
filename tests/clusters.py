"""Cluster kinds the conformance suite runs against, and how to make each.

Each kind is a context manager factory `(world_size, timeout) -> Cluster`; every kind must
give identical results on the same program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from mpplug import Cluster
from simulator import Simulator

PLUGIN_DIR = Path(__file__).parent / "plugins"


@contextlib.contextmanager
def simulator_cluster(world_size: int, timeout: float) -> Iterator[Cluster]:
    with Simulator(world_size, timeout=timeout) as sim:
        yield sim


KINDS: dict[str, Callable[[int, float], contextlib.AbstractContextManager[Cluster]]] = {
    "simulator": simulator_cluster,
}
