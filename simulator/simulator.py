"""`Simulator`: N parties as persistent threads in this process, one runtime and device each.

Programs reach every party as the same bytes; values crossing parties go through the wire codec.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mpplug.config import ClusterSpec
from mpplug.core import ValueType
from mpplug.core.custom_calls import CustomCallPolicy
from mpplug.core.graph import Graph
from mpplug.core.mpobject import MPObject
from mpplug.core.parties import PartySet
from mpplug.errors import ExecutionAborted, MPPlugError, PartyUnavailableError, WireError
from mpplug.frontend.tracer import Program
from mpplug.kernels import jax_exec
from mpplug.kernels.datasets import Datasets
from mpplug.kernels.devices import export_platform
from mpplug.runtime import codec
from mpplug.runtime.cluster import Cluster
from mpplug.runtime.communicator import Communicator, Key, Mailbox
from mpplug.runtime.party import Party
from mpplug.runtime.profile import Recorder

DEFAULT_TIMEOUT = 30.0
ABORT_GRACE = 2.0


class InMemoryCommunicator(Communicator):
    """Delivers values straight into the destination party's mailbox. A JAX array, which is
    immutable, is handed over as it is, on device (moved to the receiver's device when that
    is another): no host round trip, and the sender does not wait for it to be computed.
    Anything else goes through the wire codec, as real parties would see it."""

    def __init__(
        self, rank: int, mailboxes: Sequence[Mailbox], devices: Sequence[Any] | None = None
    ) -> None:
        self.rank = rank
        self.world_size = len(mailboxes)
        self._mailboxes = mailboxes
        self._devices = devices if devices is not None else [None] * len(mailboxes)

    def send(self, key: Key, value: Any) -> None:
        if isinstance(value, jax.Array):
            device = self._devices[key.dst]
            if device is not None and value.devices() != {device}:
                value = jax.device_put(value, device)
            self._mailboxes[key.dst].deliver(key, value)
        else:
            self._mailboxes[key.dst].deliver(key, codec.to_wire(value))

    def recv(self, key: Key, timeout: float) -> Any:
        data = self._mailboxes[self.rank].take(key, timeout)
        if not isinstance(data, codec.WireValue):
            return data
        try:
            return codec.from_wire(data, where="the value")
        except WireError as exc:  # the key is spelled out only when needed: it costs a join
            raise WireError(f"party {self.rank} received {key}: {exc}") from None

    def check(self, exec_id: str) -> None:
        self._mailboxes[self.rank].check(exec_id)


def _parse_world(
    world: Any,
) -> tuple[list[str], list[Any], list[Datasets], list[CustomCallPolicy]]:
    """Party names, device specs and datasets from a world size, names or a ClusterSpec
    (whose data files are checked here, as each party's host checks its own)."""
    if isinstance(world, int) and not isinstance(world, bool):
        if world < 1:
            raise ValueError(f"expected at least one party, got world size {world}")
        world = [f"P{i}" for i in range(world)]
    if isinstance(world, Sequence) and not isinstance(world, str):
        names = list(world)
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"expected a non-empty list of party names, got {world!r}")
        world = ClusterSpec.from_dict(
            {
                "parties": [
                    {"name": n, "endpoint": f"127.0.0.1:{i + 1}"} for i, n in enumerate(names)
                ]
            },
            source="Simulator names",
        )
    parties = getattr(world, "parties", None)
    if parties is None:
        raise TypeError(
            f"expected a world size, party names, a ClusterSpec or a cluster file, got "
            f"{type(world).__name__}"
        )
    datasets = [Datasets(p.name, p.data, p.outputs) for p in parties]
    policies = [p.custom_calls for p in parties]
    return [p.name for p in parties], [p.device for p in parties], datasets, policies


def _devices(mode: Any, declared: list[Any]) -> list[Any]:
    n = len(declared)
    if mode == "auto":
        local = jax.local_devices()
        return [declared[i] or local[i % len(local)] for i in range(n)]
    if mode is None:
        return list(declared)
    if isinstance(mode, str) or len(mode) != n:
        raise ValueError(
            f"devices: expected 'auto', None or a list of {n} device specs, got {mode!r}"
        )
    return list(mode)


class Simulator(Cluster):
    """A thread-per-party cluster implementing `mpplug.Cluster`.

    `world` is a number of parties (named P0, P1, ...), a list of party names, a ClusterSpec
    or a cluster file (names, devices, datasets and outputs from it; each party's data files
    are checked at construction).
    `devices="auto"` binds party i to local device i modulo the device count. `timeout`
    bounds every receive; one execution may run for `execute_timeout` (default 10 x timeout).
    `custom_calls` (entries as in a cluster file) sets every party's custom-call policy;
    by default each party has its cluster file's, or the default a party server has.
    """

    def __init__(
        self,
        world: int | Sequence[str] | ClusterSpec | str | Path,
        *,
        devices: str | Sequence[Any] | None = "auto",
        timeout: float = DEFAULT_TIMEOUT,
        execute_timeout: float | None = None,
        custom_calls: Sequence[str] | str | None = None,
    ) -> None:
        if isinstance(world, str | Path):
            world = ClusterSpec.from_yaml(world)
        names, declared, datasets, policies = _parse_world(world)
        if custom_calls is not None:
            policies = [CustomCallPolicy.parse(custom_calls, "custom_calls")] * len(names)
        bound = _devices(devices, declared)
        self._mailboxes = [Mailbox(r) for r in range(len(names))]
        party_devices: list[Any] = [None] * len(names)  # filled once the runtimes resolve them
        self._parties = [
            Party(
                r,
                len(names),
                InMemoryCommunicator(r, self._mailboxes, party_devices),
                device=bound[r],
                datasets=datasets[r],
                custom_calls=policies[r],
            )
            for r in range(len(names))
        ]
        party_devices[:] = [p.runtime.resolved_device() for p in self._parties]
        platforms = sorted(
            {
                export_platform(p.runtime.resolved_device() or jax.devices()[0])
                for p in self._parties
            }
        )
        super().__init__(names, timeout, platforms)
        self._stores: list[dict[str, Any]] = [{} for _ in names]
        self._workers = [
            ThreadPoolExecutor(1, thread_name_prefix=f"mpplug-party{r}") for r in range(len(names))
        ]
        self.execute_timeout = execute_timeout if execute_timeout is not None else 10 * timeout
        # every party must see executions in the same order, or two concurrent evaluates
        # could each hold a party the other waits for
        self._submit_lock = threading.Lock()

    def devices(self) -> list[Any]:
        """The JAX device each party is bound to (None: JAX's default)."""
        return [p.runtime.resolved_device() for p in self._parties]

    # Stores are plain dicts: put and fetch touch them from the caller's thread (an evaluate
    # that wrote a value has finished before its handle exists), still through the codec.
    def _put(self, rank: int, name: str, value: Any) -> None:
        self._stores[rank][name] = codec.from_wire(codec.to_wire(value), where=f"put {name}")

    def _fetch(self, rank: int, name: str) -> Any:
        value = codec.from_wire(self._load(rank, name), where=f"fetch {name}")
        return value if codec.is_table(value) else np.asarray(value)

    def _load(self, rank: int, name: str) -> codec.WireValue:
        if name not in self._stores[rank]:
            raise MPPlugError(f"party {rank} holds no value named {name!r} (released?)")
        return codec.to_wire(self._stores[rank][name])

    def _dataset_type(self, rank: int, name: str) -> ValueType:
        return self._parties[rank].runtime.datasets.info(name)

    def _release(self, names: list[str], ranks: PartySet) -> None:
        for rank in ranks:
            for name in names:
                self._stores[rank].pop(name, None)

    def _traced(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Program, list[MPObject]]:
        with jax_exec.planning_written():  # the parties run what the trace writes, here
            return super()._traced(fn, args, kwargs)

    def _run(self, program: Program, in_names: list[str], out_names: list[str]) -> None:
        exec_id = uuid.uuid4().hex
        timeline = self._timeline
        recorders = [Recorder(party.rank) if timeline else None for party in self._parties]
        digest = program.digest
        # decoded from its bytes once, as each party would decode them (bytes the program's
        # own graph wrote: canonical, so its digest is not written again)
        loading = not all(party.has_program(digest) for party in self._parties)
        graph = Graph.from_bytes(program.to_bytes(), canonical=True) if loading else None
        with self._submit_lock:
            futures = [
                worker.submit(
                    self._execute,
                    party,
                    program,
                    graph,
                    exec_id,
                    in_names,
                    out_names,
                    recorder,
                )
                for party, worker, recorder in zip(
                    self._parties, self._workers, recorders, strict=True
                )
            ]
        try:
            self._wait(futures, exec_id)
        except BaseException:
            self._release(out_names, frozenset(range(self.world_size)))  # partial outputs
            raise
        finally:
            if timeline is not None:
                for recorder in recorders:
                    timeline.extend(recorder.spans)  # type: ignore[union-attr]

    def _execute(
        self,
        party: Party,
        program: Program,
        graph: Graph | None,
        exec_id: str,
        in_names: list[str],
        out_names: list[str],
        recorder: Recorder | None,
    ) -> None:
        store = self._stores[party.rank]
        try:
            digest = program.digest
            if not party.has_program(digest):
                if graph is None:  # evicted since `_run` looked: decode it again
                    graph = Graph.from_bytes(program.to_bytes(), canonical=True)
                party.load_graph(graph, digest)
            inputs = [store.get(name) for name in in_names]
            outputs = party.execute(digest, exec_id, inputs, self.timeout, recorder)
        except BaseException as exc:
            if not isinstance(exc, ExecutionAborted):
                reason = f"party {party.rank} failed: {type(exc).__name__}"
                for mailbox in self._mailboxes:
                    mailbox.abort(exec_id, reason)
            raise
        finally:
            self._mailboxes[party.rank].finish(exec_id)
        for name, value in zip(out_names, outputs, strict=True):
            if value is not None:
                store[name] = value

    def _wait(self, futures: list[Future[None]], exec_id: str) -> None:
        """Wait for every party; after a failure, give the others a short grace to unwind
        (a kernel stuck in a straggler must not hold the caller) and raise the root error."""
        _, pending = wait(futures, timeout=self.execute_timeout, return_when=FIRST_EXCEPTION)
        if pending and not any(f.done() and f.exception() for f in futures):
            stuck = next(rank for rank, f in enumerate(futures) if f in pending)
            for mailbox in self._mailboxes:
                mailbox.abort(exec_id, f"party {stuck} did not finish in time")
            raise PartyUnavailableError(
                self.parties[stuck], f"no answer within {self.execute_timeout:g}s"
            )
        if pending:
            wait(pending, timeout=ABORT_GRACE)
        errors = [e for f in futures if f.done() and (e := f.exception()) is not None]
        root = [e for e in errors if not isinstance(e, ExecutionAborted)]
        if root or errors:
            raise (root or errors)[0]

    def _close(self) -> None:
        for worker in self._workers:  # a kernel stuck in a party must not hold close()
            worker.shutdown(wait=False, cancel_futures=True)
        for party in self._parties:
            party.close()
        for store in self._stores:
            store.clear()

    def __repr__(self) -> str:
        return f"Simulator({self.world_size} parties: {', '.join(self.parties)})"
