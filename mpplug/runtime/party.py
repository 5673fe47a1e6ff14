"""`Party`: one party's engine, shared by the simulator and the gRPC party server.

It caches programs by digest (parsed graph and plan, its functions compiled at load) and runs
them against its runtime.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from mpplug.core.custom_calls import CustomCallPolicy, CustomCallRefused
from mpplug.core.graph import Graph
from mpplug.errors import InvalidPFunctionError, InvalidProgramError
from mpplug.kernels import KernelRuntime
from mpplug.kernels.datasets import Datasets
from mpplug.kernels.devices import export_platform
from mpplug.kernels.jax_exec import ATTR_CUSTOM_CALLS
from mpplug.kernels.prepare import (
    COMPILE_S_PER_FUNCTION,
    Preparation,
    tier_up_after_s,
    tier_up_waits,
)
from mpplug.kernels.runtime import LRUCache
from mpplug.runtime.communicator import Communicator
from mpplug.runtime.interpreter import Interpreter, describe_op
from mpplug.runtime.profile import Recorder, Span

DEFAULT_PROGRAM_CACHE = 128


class UnknownProgramError(InvalidProgramError, LookupError):
    """A digest this party has not been sent the program for."""


class Party:
    """Rank `rank` of `world_size`: program cache, kernel runtime (with the party's
    datasets) and communicator."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        communicator: Communicator,
        *,
        device: Any = None,
        program_cache_size: int = DEFAULT_PROGRAM_CACHE,
        datasets: Datasets | None = None,
        untrusted_artifacts: bool = False,
        custom_calls: CustomCallPolicy | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.communicator = communicator
        self.runtime = KernelRuntime(
            rank,
            world_size,
            device,
            datasets=datasets,
            untrusted_artifacts=untrusted_artifacts,
            custom_calls=custom_calls,
        )
        self._programs: LRUCache[str, _Loaded] = LRUCache(program_cache_size)
        self._tier_up_lock = threading.Lock()

    def has_program(self, digest: str) -> bool:
        return digest in self._programs

    def load_program(self, data: bytes, expected_digest: str | None = None) -> str:
        """Parse and plan program bytes (once per digest), and compile the functions this
        party runs, all at once before the first run starts; return the digest.

        With `expected_digest`, bytes whose canonical form has another digest are refused
        before anything is cached.
        """
        return self.load_graph(Graph.from_bytes(data), expected_digest)

    def load_graph(self, graph: Graph, expected_digest: str | None = None) -> str:
        """`load_program` of a program already decoded from its bytes (`Graph.from_bytes`):
        a simulator's parties share one decoding."""
        if expected_digest is not None and graph.digest != expected_digest:
            raise InvalidProgramError(
                f"expected the program's canonical bytes (Graph.to_bytes(), digest "
                f"{graph.digest}), got other bytes for it (digest {expected_digest})"
            )
        if graph.world_size != self.world_size:
            raise InvalidProgramError(
                f"program {graph.name!r} is for {graph.world_size} parties, "
                f"this cluster has {self.world_size}"
            )
        self._programs.get_or_create(graph.digest, lambda: self._load(graph))
        return graph.digest

    def _load(self, graph: Graph) -> _Loaded:
        interpreter = Interpreter(graph, self.rank)
        self._check_custom_calls(interpreter)
        return _Loaded(interpreter, Preparation(interpreter.functions(), self.runtime))

    def _check_custom_calls(self, interpreter: Interpreter) -> None:
        """Refuse, before anything runs, a program whose functions at this party declare
        custom-call targets this party's policy does not admit (the compile checks the
        module's actual targets again)."""
        platform = export_platform(self.runtime.resolved_device() or jax.devices()[0])
        for op, pfunc in interpreter.calls():
            declared = pfunc.attrs.get(ATTR_CUSTOM_CALLS, ())
            if not isinstance(declared, tuple | list):
                declared = (str(declared),)
            where = f"party {self.rank}: {describe_op(interpreter.graph, op)}"
            try:
                self.runtime.custom_calls.check(map(str, declared), platform, where)
            except CustomCallRefused as exc:
                raise InvalidPFunctionError(str(exc)) from None

    def interpreter(self, digest: str) -> Interpreter:
        return self._loaded(digest).interpreter

    def _loaded(self, digest: str) -> _Loaded:
        found = self._programs.get(digest)
        if found is None:
            raise UnknownProgramError(f"party {self.rank} holds no program with digest {digest}")
        return found

    def execute(
        self,
        digest: str,
        exec_id: str,
        inputs: Sequence[Any],
        timeout: float,
        recorder: Recorder | None = None,
    ) -> list[Any]:
        """Run program `digest` once its functions are ready (the receive timeouts start then):
        interpreted plans where they can run the first run; once the program is hot (see
        `_hot`), each function's compiled code once its compile (started then, in the
        background) is done.
        Returns per-output values (None where not held here). With a `recorder`,
        each step is recorded in it."""
        loaded = self._loaded(digest)
        if loaded.runs and loaded.tier_up is None and self._hot(loaded):
            self._turned_hot(loaded)
        loaded.runs += 1
        label = f"party {self.rank}: program {loaded.interpreter.graph.name!r} ({digest[:12]})"
        loaded.preparation.wait(label)
        if loaded.tier_up is not None and tier_up_waits():
            loaded.tier_up.wait(label)
        if recorder is not None:  # each run's profile shows compiles that ended before it
            for preparation, what in (
                (loaded.preparation, "prepare functions"),
                (loaded.tier_up, "compile functions"),
            ):
                if preparation is not None and not preparation.reported and preparation.done():
                    preparation.reported = True
                    if preparation.futures:
                        recorder.spans.append(_compile_span(self.rank, preparation, what))
        start = time.perf_counter()
        timer = None
        if loaded.tier_up is None and not tier_up_waits():  # a long run turns hot as it goes
            compiling = COMPILE_S_PER_FUNCTION * len(loaded.preparation.futures)
            worth = max(tier_up_after_s(), compiling)
            timer = threading.Timer(
                max(0.0, worth - loaded.interpreted_s), self._turned_hot, [loaded]
            )
            timer.daemon = True
            timer.start()
        try:
            return loaded.interpreter.run(
                inputs, self.communicator, exec_id, self.runtime, timeout, recorder
            )
        finally:
            if timer is not None:
                timer.cancel()
            if loaded.tier_up is None:
                loaded.interpreted_s += time.perf_counter() - start

    def _turned_hot(self, loaded: _Loaded) -> None:
        """Start the program's compiles (once): between runs when it is hot, or from a run's
        timer once that run has taken `tier_up_after_s` (with the runs before it) and as long
        as its functions would take to compile, so that its later steps (a loop's next
        iterations) run each function compiled once its executable is there. A shorter run
        would end before they help, and they would only slow it down."""
        with self._tier_up_lock:
            if loaded.tier_up is None:
                functions = loaded.interpreter.functions()
                loaded.tier_up = Preparation(functions, self.runtime, "tier_up")

    @staticmethod
    def _hot(loaded: _Loaded) -> bool:
        """Whether a program that has run is worth compiling now: at its second run when
        runs wait for the compiles, else once its runs took `tier_up_after_s` in all."""
        return tier_up_waits() or loaded.interpreted_s >= tier_up_after_s()

    def close(self) -> None:
        """Drop the compiles of every program's functions that have not started."""
        for loaded in self._programs.values():
            if loaded.tier_up is not None:
                loaded.tier_up.cancel()


def _compile_span(rank: int, preparation: Preparation, what: str) -> Span:
    duration = preparation.finished_ns - preparation.started_ns
    return Span(
        rank,
        what,
        "compile",
        preparation.started_ns,
        max(duration, 1),
        {"functions": len(preparation.futures)},
    )


@dataclass
class _Loaded:
    """A program ready to run here: its functions readied at load (interpreted where they
    can be), and compiled once it is hot."""

    interpreter: Interpreter
    preparation: Preparation
    runs: int = 0
    interpreted_s: float = 0.0
    """Time its runs took before its compiles started."""
    tier_up: Preparation | None = None
