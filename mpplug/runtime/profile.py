"""The timeline of a profiled run: spans each party records (ops, sends, receives, kernel
compiles and runs) and the driver's calls, written as Chrome trace event JSON.

A `Recorder` collects one party's spans for one execution; a `Timeline` gathers every party's
and the caller's, and writes them with one track per party (Perfetto or chrome://tracing).
A profiled trace records its phases (`phase`) on the caller's track.
Timestamps are wall-clock nanoseconds (`time.time_ns`), so parties on hosts with synchronized
clocks line up.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CALLER = -1
"""The party index of the caller's own spans (the driver, or the Simulator's caller)."""

TRACE = "trace"
"""The category of the caller's spans that time a trace and its phases (see `phase`)."""

CATEGORIES = frozenset({"op", "send", "recv", "compile", "run", "rpc", TRACE})


@dataclass(frozen=True, slots=True)
class Span:
    """Something that took time at one party: `category` is "op", "send", "recv",
    "compile", "run", "rpc" or "trace"; `args` are the details shown with it."""

    party: int
    name: str
    category: str
    start_ns: int
    duration_ns: int
    args: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """The spans one party records in one execution (or the caller's in a profile block)."""

    __slots__ = ("party", "spans")

    def __init__(self, party: int) -> None:
        self.party = party
        self.spans: list[Span] = []
        _listen_for_compiles()

    def add(self, name: str, category: str, start_ns: int, **args: Any) -> None:
        """A span from `start_ns` (a `time.time_ns()` taken before) until now."""
        self.spans.append(
            Span(self.party, name, category, start_ns, time.time_ns() - start_ns, args)
        )

    @contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the block as a span; details added to the yielded dict are kept with it."""
        start = time.time_ns()
        try:
            yield args
        finally:
            self.add(name, category, start, **args)


_tracing_into: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "mpplug_tracing_into", default=None
)


@contextmanager
def tracing_into(recorder: Recorder | None) -> Iterator[None]:
    """Inside the block, the `phase` spans of this thread's trace go to `recorder` (None: to
    nothing, as outside any profile)."""
    token = _tracing_into.set(recorder)
    try:
        yield
    finally:
        _tracing_into.reset(token)


@contextmanager
def phase(name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Record the block as a "trace" span where a profiled trace runs on this thread (see
    `tracing_into`); elsewhere it records nothing. Details added to the yielded dict are
    kept with the span."""
    recorder = _tracing_into.get()
    if recorder is None:
        yield args
        return
    with recorder.span(name, TRACE, **args) as details:
        yield details


_COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)
_compiling = threading.local()
_listening = threading.Lock()
_listener_added = False


def _listen_for_compiles() -> None:
    """Have JAX report its compile times to `compile_seconds` blocks (once per process, and
    only once something is profiled: nothing happens on import)."""
    global _listener_added
    with _listening:
        if not _listener_added:
            from jax import monitoring

            monitoring.register_event_duration_secs_listener(_on_duration)
            _listener_added = True


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    totals = getattr(_compiling, "totals", None)
    if totals is not None and event in _COMPILE_EVENTS:
        totals[0] += duration_secs


@contextmanager
def compile_seconds() -> Iterator[list[float]]:
    """Inside the block, JAX compiles on this thread add up in the yielded one-item list."""
    outer = getattr(_compiling, "totals", None)
    totals = [0.0]
    _compiling.totals = totals
    try:
        yield totals
    finally:
        _compiling.totals = outer
        if outer is not None:
            outer[0] += totals[0]


class Timeline:
    """Every span of the runs inside one `Cluster.profile()` block, by party."""

    def __init__(self, party_names: Sequence[str]) -> None:
        self.party_names = list(party_names)
        self.caller = Recorder(CALLER)
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def extend(self, spans: Sequence[Span]) -> None:
        with self._lock:
            self._spans.extend(spans)

    @property
    def spans(self) -> list[Span]:
        """Every span, the caller's included, in start order."""
        with self._lock:
            return sorted([*self._spans, *self.caller.spans], key=lambda s: s.start_ns)

    def chrome_trace(self) -> dict[str, Any]:
        """The spans as a Chrome trace event document: one process per party (the caller
        first), complete ("X") events with microsecond times from the first span."""
        spans = self.spans
        origin = spans[0].start_ns if spans else 0
        names = {CALLER: "caller", **dict(enumerate(self.party_names))}
        events: list[dict[str, Any]] = []
        for party, name in names.items():
            pid = party + 1
            events.append(_meta(pid, "process_name", name))
            events.append(_meta(pid, "process_sort_index", pid, key="sort_index"))
        for span in spans:
            events.append(
                {
                    "name": span.name,
                    "cat": span.category,
                    "ph": "X",
                    "ts": (span.start_ns - origin) / 1e3,
                    "dur": span.duration_ns / 1e3,
                    "pid": span.party + 1,
                    "tid": _LANES.get(span.category, 0),
                    "args": span.args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        """Write `chrome_trace()` as JSON to `path`; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace()))
        return path


_LANES = {"op": 0, "compile": 0, "run": 0, "send": 1, "recv": 1, "rpc": 0}
"""Track lanes within a party: ops (with their kernels' compile and run nested inside) on
one, value transfers on another."""


def _meta(pid: int, name: str, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": 0, "args": {key: value}}
