"""`Cluster`: the one interface the simulator and the gRPC driver both implement.

It traces and caches programs, names values that stay at the parties, and fetches on request.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from mpplug.core import TensorType, ValueType
from mpplug.core.mpobject import MPObject
from mpplug.core.parties import PartySet, format_parties
from mpplug.errors import MPPlugError, TraceError
from mpplug.frontend.tracer import MPFunction, Program, static_key, trace
from mpplug.kernels.runtime import LRUCache
from mpplug.runtime.codec import as_host_array, is_table, payload_nbytes
from mpplug.runtime.profile import Timeline, phase, tracing_into

_cluster_ids = itertools.count()

PROGRAM_CACHE_SIZE = 256


class ClusterValue(MPObject):
    """A value held at parties of one cluster, named `name` there; the caller's handle."""

    __slots__ = ("__weakref__", "cluster", "name")

    def __init__(self, cluster: Cluster, name: str, type: ValueType, parties: PartySet) -> None:
        super().__init__(type, parties)
        self.cluster = cluster
        self.name = name

    def __repr__(self) -> str:
        return f"ClusterValue({self.name}: {self.type} @ {format_parties(self.parties)})"


class Cluster(ABC):
    """N parties that run programs; values stay at the parties until fetched.

    Subclasses move bytes (`_put`, `_run`, `_fetch`, `_release`, `_close`) and ask parties
    about their datasets (`_dataset_type`); this class does
    tracing, program caching, argument checks and handle bookkeeping.
    """

    def __init__(
        self, party_names: Sequence[str], timeout: float, platforms: Sequence[str] | None = None
    ) -> None:
        self._party_names = list(party_names)
        self.timeout = timeout
        self.platforms = tuple(platforms) if platforms is not None else None
        self._id = next(_cluster_ids)
        self._names = itertools.count()
        self._programs: LRUCache[Any, Program] = LRUCache(PROGRAM_CACHE_SIZE)
        self._closed = False
        self._timeline: Timeline | None = None

    # -- the public interface -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._party_names)

    @property
    def parties(self) -> list[str]:
        return list(self._party_names)

    def rank_of(self, party: int | str) -> int:
        if isinstance(party, str):
            if party not in self._party_names:
                raise ValueError(f"unknown party {party!r}; parties: {self._party_names}")
            return self._party_names.index(party)
        if (
            isinstance(party, bool)
            or not isinstance(party, int)
            or not (0 <= party < self.world_size)
        ):
            raise ValueError(
                f"expected a rank in 0..{self.world_size - 1} or a party name, got {party!r}"
            )
        return party

    @contextlib.contextmanager
    def profile(self) -> Iterator[Timeline]:
        """Record a timeline of what runs inside the block: at each party every op, send and
        receive (with bytes and waiting time) and kernel compile and run, and the caller's
        calls. `timeline.write("trace.json")` saves it for Perfetto or chrome://tracing.

        Every call on this cluster inside the block is recorded, from any thread."""
        timeline = Timeline(self._party_names)
        outer, self._timeline = self._timeline, timeline
        try:
            yield timeline
        finally:
            self._timeline = outer

    def put(self, party: int | str, value: Any) -> ClusterValue:
        """Send a host value (an array, or a `pyarrow.Table`) to one party; returns its
        handle. A table's handle knows its columns and row count."""
        self._check_open()
        start = time.time_ns()
        rank = self.rank_of(party)
        vtype: ValueType
        if is_table(value):
            from mpplug.tables import arrow

            vtype = arrow.table_type(value, f"put to party {rank}")
            value = arrow.conform(value, vtype, f"put to party {rank}")
        else:
            value = as_host_array(value)
            vtype = TensorType(value.dtype, value.shape)
        name = self._new_name()
        self._put(rank, name, value)
        if self._timeline is not None:
            nbytes = payload_nbytes(value)
            self._timeline.caller.add("put", "rpc", start, party=rank, bytes=nbytes)
        return self._handle(name, vtype, frozenset({rank}))

    def compile(self, fn: Callable[..., Any] | Program, *args: Any, **kwargs: Any) -> Program:
        """Trace `fn` for this cluster (cached by function and argument signature)."""
        if isinstance(fn, Program):
            return fn
        return self._traced(fn, args, kwargs)[0]

    def evaluate(self, fn: Callable[..., Any] | Program, *args: Any, **kwargs: Any) -> Any:
        """Run a program; returns its outputs as handles (a pytree of ClusterValue).

        Arguments, positional or keyword, are pytrees: handles become the program's party
        values, anything else is a static Python value the program is traced for."""
        self._check_open()
        start = time.time_ns()
        if isinstance(fn, Program):
            if kwargs:
                raise TraceError(
                    f"a compiled Program takes its party values positionally, got keyword "
                    f"arguments {sorted(kwargs)}"
                )
            program = fn
            inputs = list(args)
            if program.world_size != self.world_size:
                raise TraceError(
                    f"program is for {program.world_size} parties, this cluster "
                    f"has {self.world_size}"
                )
            self._check_inputs(program, inputs)
        else:
            program, inputs = self._traced(fn, args, kwargs)
        handles = [self._own(x, f"argument {i}") for i, x in enumerate(inputs)]
        out_names = [self._new_name() for _ in program.output_types]
        self._run(program, [h.name for h in handles], out_names)
        if self._timeline is not None:
            self._timeline.caller.add("evaluate", "rpc", start, program=program.graph.name)
        outs = [
            self._handle(name, t, p)
            for name, (t, p) in zip(out_names, program.output_types, strict=True)
        ]
        return program.unflatten(outs)

    def fetch(self, obj: Any, party: int | str | None = None) -> Any:
        """Values of `obj`, a handle or any pytree of handles (other leaves come back as
        they are), in the same structure. Each handle gives a list with one entry per party
        (None where not held), or with `party=`, that party's value as a numpy array. Each
        party is asked once, whatever the number of handles."""
        self._check_open()
        start = time.time_ns()
        leaves, tree = jax.tree.flatten(obj)
        handles = {
            i: self._own(leaf, f"fetch leaf {i}")
            for i, leaf in enumerate(leaves)
            if isinstance(leaf, MPObject)
        }
        wanted: dict[int, list[str]] = {}
        if party is not None:
            rank = self.rank_of(party)
            for h in handles.values():
                if rank not in h.parties:
                    raise ValueError(f"party {rank} does not hold {h!r}")
                wanted.setdefault(rank, []).append(h.name)
        else:
            for h in handles.values():
                for r in sorted(h.parties):
                    wanted.setdefault(r, []).append(h.name)
        got = self._fetch_groups({r: list(dict.fromkeys(names)) for r, names in wanted.items()})
        found = {r: dict(zip(dict.fromkeys(wanted[r]), got[r], strict=True)) for r in got}
        out = list(leaves)
        for i, h in handles.items():
            if party is not None:
                out[i] = found[self.rank_of(party)][h.name]
            else:
                out[i] = [
                    found[r][h.name] if r in h.parties else None for r in range(self.world_size)
                ]
        if self._timeline is not None:
            self._timeline.caller.add("fetch", "rpc", start, values=len(handles))
        return jax.tree.unflatten(tree, out)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Cluster:
        """`with cluster:` makes it the current cluster of this thread or task (for `mp.put`,
        `mp.evaluate` and `mp.fetch`) until the block ends, then closes it."""
        _current.set((*_current.get(), self))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            entered = list(_current.get())
            if self in entered:
                del entered[len(entered) - 1 - entered[::-1].index(self)]
                _current.set(tuple(entered))
        finally:
            self.close()

    # -- what subclasses provide ----------------------------------------------------------
    @abstractmethod
    def _put(self, rank: int, name: str, value: Any) -> None: ...

    @abstractmethod
    def _run(self, program: Program, in_names: list[str], out_names: list[str]) -> None: ...

    @abstractmethod
    def _fetch(self, rank: int, name: str) -> Any: ...

    def _fetch_groups(self, wanted: dict[int, list[str]]) -> dict[int, list[Any]]:
        """The values named, by party; subclasses ask each party once, in parallel."""
        return {r: [self._fetch(r, name) for name in names] for r, names in wanted.items()}

    @abstractmethod
    def _release(self, names: list[str], ranks: PartySet) -> None: ...

    @abstractmethod
    def _dataset_type(self, rank: int, name: str) -> ValueType:
        """The dtype and shape of party `rank`'s dataset `name`, asked of that party."""

    @abstractmethod
    def _close(self) -> None: ...

    # -- bookkeeping ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MPPlugError(f"{type(self).__name__} is closed")

    def _new_name(self) -> str:
        return f"v{self._id}.{next(self._names)}"

    def _handle(self, name: str, ttype: ValueType, parties: PartySet) -> ClusterValue:
        handle = ClusterValue(self, name, ttype, parties)
        weakref.finalize(handle, _release_quietly, weakref.ref(self), name, parties)
        return handle

    def _own(self, x: Any, where: str) -> ClusterValue:
        if not isinstance(x, ClusterValue):
            raise TraceError(f"{where}: expected a value of this cluster, got {x!r}")
        if x.cluster is not self:
            raise TraceError(f"{where}: {x!r} belongs to another cluster")
        return x

    def _check_inputs(self, program: Program, inputs: list[Any]) -> None:
        expected = program.input_types
        if len(inputs) != len(expected):
            raise TraceError(f"program takes {len(expected)} party values, got {len(inputs)}")
        for i, (x, (ttype, parties)) in enumerate(zip(inputs, expected, strict=True)):
            h = self._own(x, f"argument {i}")
            if h.type != ttype or h.parties != parties:
                raise TraceError(
                    f"argument {i}: expected {ttype} @ {format_parties(parties)}, "
                    f"got {h.type} @ {format_parties(h.parties)}"
                )

    def _traced(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Program, list[MPObject]]:
        """The program for `fn(*args, **kwargs)` (traced once per signature) and its
        party-value arguments, which are exactly the MPObject leaves, in order."""
        every = (args, kwargs)
        inputs = [leaf for leaf in jax.tree.leaves(every) if isinstance(leaf, MPObject)]

        def traced() -> Program:
            timeline = self._timeline
            with (
                tracing_into(timeline.caller if timeline is not None else None),
                phase("trace", function=getattr(fn, "__name__", type(fn).__name__)),
            ):
                return trace(
                    fn,
                    args,
                    world_size=self.world_size,
                    party_names=self._party_names,
                    platforms=self.platforms,
                    dataset_type=self._dataset_type,
                    kwargs=kwargs,
                )[0]

        key = _signature(fn, every)
        program = traced() if key is None else self._programs.get_or_create(key, traced)
        return program, inputs


_current: contextvars.ContextVar[tuple[Cluster, ...]] = contextvars.ContextVar(
    "mpplug_clusters", default=()
)


def current_cluster(helper: str) -> Cluster:
    """The innermost cluster of a `with cluster:` block in this context."""
    entered = _current.get()
    if not entered:
        raise MPPlugError(
            f"mp.{helper} works on the current cluster, and there is none: call it inside "
            f"`with mp.Simulator(...) as sim:` (or `with mp.Driver(...)`), or call sim.{helper}"
        )
    return entered[-1]


def _signature(fn: Callable[..., Any], args: Any) -> Any:
    """A hashable key for (fn, argument types and placements, static values), or None."""
    leaves, tree = jax.tree.flatten(args)
    parts = tuple((x.type, x.parties) if isinstance(x, MPObject) else static_key(x) for x in leaves)
    if any(part is None for part in parts):
        return None
    identity = (fn.fn, fn.fuse) if isinstance(fn, MPFunction) else fn
    return (identity, tree, parts)


def _release_quietly(cluster_ref: weakref.ref[Cluster], name: str, parties: PartySet) -> None:
    cluster = cluster_ref()
    if cluster is None or cluster._closed:
        return
    with contextlib.suppress(Exception):  # best effort: the cluster may be going down
        cluster._release([name], parties)
