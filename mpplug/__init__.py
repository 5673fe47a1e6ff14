"""mpplug: multi-party computation over JAX.

Write a program once with `@mp.function`, run it on the `Simulator` or on real parties
through the gRPC `Driver`.
"""

from __future__ import annotations

from typing import Any

from mpplug import errors
from mpplug.config import ClusterSpec, PartySpec, TLSFiles
from mpplug.core import Attrs, DType, PFunction, TableType, TensorType
from mpplug.core.mpobject import MPObject
from mpplug.errors import (
    ArgumentMismatchError,
    CommTimeoutError,
    InvalidPFunctionError,
    MPPlugError,
    PartyError,
    PartyUnavailableError,
    TraceError,
    UnknownKernelError,
)
from mpplug.frontend.control import cond, fori_loop, while_loop
from mpplug.frontend.jax_export import jax_export
from mpplug.frontend.primitives import (
    bcast,
    constant,
    converge,
    gather,
    p2p,
    prand,
    prank,
    read,
    run_jax,
    run_jax_at,
    run_pfunc,
    shuffle_static,
    write,
)
from mpplug.frontend.tables import from_tensor, num_rows, psi, sql, to_tensor, with_rows
from mpplug.frontend.tracer import MPFunction, Program, compile, function
from mpplug.kernels import KernelRuntime, invoke, kernel
from mpplug.runtime.cluster import Cluster, ClusterValue, current_cluster

__version__ = "0.1.0"


def put(party: int | str, value: Any) -> ClusterValue:
    """Send a host value to one party of the current cluster (`with cluster:`)."""
    return current_cluster("put").put(party, value)


def evaluate(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a program on the current cluster (`with cluster:`); outputs stay at the parties."""
    return current_cluster("evaluate").evaluate(fn, *args, **kwargs)


def fetch(obj: Any, party: int | str | None = None) -> Any:
    """Bring values back from the current cluster (`with cluster:`); see `Cluster.fetch`."""
    return current_cluster("fetch").fetch(obj, party)


def __getattr__(name: str) -> Any:
    # Import lazily so `import mpplug` stays light and layers stay one-way.
    if name == "Simulator":
        from simulator import Simulator

        return Simulator
    if name == "mpc":
        import mpplug.mpc

        return mpplug.mpc
    if name == "Driver":
        from mpplug.remote.driver import Driver

        return Driver
    raise AttributeError(f"module 'mpplug' has no attribute {name!r}")


__all__ = [
    "ArgumentMismatchError",
    "Attrs",
    "Cluster",
    "ClusterSpec",
    "ClusterValue",
    "CommTimeoutError",
    "DType",
    "Driver",
    "InvalidPFunctionError",
    "KernelRuntime",
    "MPFunction",
    "MPObject",
    "MPPlugError",
    "PFunction",
    "PartyError",
    "PartySpec",
    "PartyUnavailableError",
    "Program",
    "Simulator",
    "TLSFiles",
    "TableType",
    "TensorType",
    "TraceError",
    "UnknownKernelError",
    "bcast",
    "compile",
    "cond",
    "constant",
    "converge",
    "errors",
    "evaluate",
    "fetch",
    "fori_loop",
    "from_tensor",
    "function",
    "gather",
    "invoke",
    "jax_export",
    "kernel",
    "mpc",
    "num_rows",
    "p2p",
    "prand",
    "prank",
    "psi",
    "put",
    "read",
    "run_jax",
    "run_jax_at",
    "run_pfunc",
    "shuffle_static",
    "sql",
    "to_tensor",
    "while_loop",
    "with_rows",
    "write",
]
