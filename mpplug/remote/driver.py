"""`Driver`: the `Cluster` of real parties over gRPC, with the Simulator's interface and errors.

Programs go to each party once per digest; executions fan out in parallel to the parties that
take part; values stay at the parties until fetched.

Errors: `PartyError` for an error raised on a party, `CommTimeoutError` for a receive that
waited too long, `PartyUnavailableError` naming a party that cannot be reached, dies mid-run or
lost the session (it restarted). After any failure the other parties are told to abort.

Timeouts: `timeout` bounds every receive on the parties and every call the driver makes, plus
time to move the bytes of a transfer; one execution may run for `execute_timeout` (default
10 x timeout). A party that dies is noticed at once (its connection drops), one that goes
silent within about timeout/2 (keepalive pings).

Sessions: a party closes a session that no call names for its idle timeout (an hour unless
the party is started otherwise). The driver renews its session with a KeepAlive to every party
at a third of the shortest timeout, and closes it on `close()`, or best effort when the Driver
is garbage-collected or the interpreter exits.

Releases: handles the caller drops are released at the parties with the next Execute or Fetch
to each (a GC finalizer only queues their names), or in a Release call of their own once
RELEASE_FLUSH names wait for one party. `close()` sends none: closing the session frees all.

TLS: when the cluster file has TLS paths, the driver dials every party with mutual TLS as
`tls` if given, otherwise as driver.pem / driver.key found next to the cluster's CA file
(`mpplug certs` writes them). Parties accept any client certificate signed by the cluster CA.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.core import TensorType, ValueType
from mpplug.core.parties import PartySet
from mpplug.errors import (
    DatasetError,
    ExecutionAborted,
    MPPlugError,
    PartyUnavailableError,
    UnknownKernelError,
    WireVersionError,
)
from mpplug.frontend.tracer import Program
from mpplug.kernels.devices import parse_device_spec
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.channels import keepalive_for, open_channel
from mpplug.remote.executions import ExecuteStream, Outcome, StreamFailure
from mpplug.remote.outcomes import inline_values, reply_error, reply_spans
from mpplug.remote.rpc import (
    WIRE_VERSION,
    describe_version,
    failure_of,
    missing_of,
    raw_stub,
    rpc_failure,
    status_of,
)
from mpplug.remote.streaming import (
    encode_chunks,
    fits_one_chunk,
    read_chunks,
    read_tensors,
    receive_tensor,
    transfer_deadline,
)
from mpplug.remote.tls import channel_credentials, driver_tls
from mpplug.runtime import codec
from mpplug.runtime.cluster import Cluster
from mpplug.runtime.interpreter import Interpreter

PARTY_SERVICE = pb.DESCRIPTOR.services_by_name["PartyService"]

ABORT_GRACE = 2.0
"""Seconds to let the other parties unwind after one fails before raising."""

EXECUTE_THREADS_PER_PARTY = 4
"""Threads making blocking Execute calls; a party still busy after a failure holds one."""

KEEPALIVE_FRACTION = 3
"""The driver renews its session this many times per party idle timeout."""

CLOSE_TIMEOUT = 5.0
"""The most seconds closing a session waits for each party (the lease frees it anyway)."""

INLINE_MAX_BYTES = 4096
"""Outputs up to this size come back with the Execute reply and are kept here until their
handle is dropped, so fetching a small result costs no call (the driver may fetch any value
of its session anyway)."""

STREAM_RETRY_S = 30.0
"""Seconds a driver sends Execute calls to a party that refused it an execution stream
(all of them taken) before it asks for one again."""

RELEASE_FLUSH = 256
"""Dropped handles waiting for one party before they go to it in a Release call of their own."""

RELEASE_MAX_NAMES = 4096
"""The most names one message carries (names are at most 256 characters: about 1 MiB)."""


def export_platforms(spec: ClusterSpec) -> list[str]:
    """The `jax.export` platforms the parties run on, from their device fields (cpu default)."""
    kinds = {parse_device_spec(p.device)[0] if p.device else "cpu" for p in spec.parties}
    return sorted({"cuda" if kind == "gpu" else kind for kind in kinds})


class Driver(Cluster):
    """The parties of a cluster file (or ClusterSpec), as one `mpplug.Cluster`."""

    def __init__(
        self,
        spec_or_path: ClusterSpec | str | Path,
        *,
        timeout: float = 60.0,
        tls: TLSFiles | None = None,
        execute_timeout: float | None = None,
    ) -> None:
        spec = (
            spec_or_path
            if isinstance(spec_or_path, ClusterSpec)
            # with its own certificate given, the driver needs no party's files on this host
            else ClusterSpec.from_yaml(spec_or_path, files_of=[] if tls is not None else None)
        )
        super().__init__(spec.names, timeout, export_platforms(spec))
        self.spec = spec
        self.execute_timeout = execute_timeout if execute_timeout is not None else 10 * timeout
        self.session = uuid.uuid4().hex
        client_tls = driver_tls(spec, tls)
        credentials = channel_credentials(client_tls) if client_tls is not None else None
        keepalive = keepalive_for(timeout)
        self._channels = [open_channel(p.endpoint, credentials, keepalive) for p in spec.parties]
        self._stubs = [rpc_pb.PartyServiceStub(channel) for channel in self._channels]
        self._streams = [raw_stub(channel, PARTY_SERVICE) for channel in self._channels]
        self._shipped: list[set[str]] = [set() for _ in spec.parties]
        self._participants: dict[str, list[int]] = {}
        self._kernels: list[frozenset[str]] = [frozenset() for _ in spec.parties]
        self._inline: list[dict[str, np.ndarray[Any, Any]]] = [{} for _ in spec.parties]
        self._sizes: dict[str, int] = {}
        self._released: collections.deque[tuple[tuple[str, ...], PartySet]] = collections.deque()
        self._unreleased: list[list[str]] = [[] for _ in spec.parties]
        self._in_flight: set[grpc.Future] = set()
        self._execute_streams: list[ExecuteStream | None] = [None for _ in spec.parties]
        self._streams_refused_until = [0.0 for _ in spec.parties]
        self._streams_lock = threading.Lock()
        self._release_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            EXECUTE_THREADS_PER_PARTY * spec.world_size, thread_name_prefix="mpplug-driver"
        )
        self._stop_keepalive = threading.Event()
        # Closes the session when the Driver is closed, collected or left at exit; it must
        # not refer to the Driver itself.
        self._close_session = weakref.finalize(
            self,
            _shut_down,
            list(self._stubs),
            self.session,
            min(timeout, CLOSE_TIMEOUT),
            self._stop_keepalive,
            self._pool,
            list(self._channels),
            self._execute_streams,
        )
        try:
            idle_timeouts = self._open_sessions()
        except BaseException:
            self._close_session()
            raise
        self.keepalive_interval = min(idle_timeouts) / KEEPALIVE_FRACTION
        threading.Thread(
            target=_keep_alive,
            args=(
                list(self._stubs),
                pb.KeepAliveRequest(session=self.session),
                self.keepalive_interval,
                timeout,
                self._stop_keepalive,
            ),
            name="mpplug-driver-keepalive",
            daemon=True,
        ).start()

    def _fetch_groups(self, wanted: dict[int, list[str]]) -> dict[int, list[np.ndarray[Any, Any]]]:
        """Values the parties sent back with their Execute replies are served from here;
        the rest are fetched, one call per party, in parallel."""
        found: dict[int, list[np.ndarray[Any, Any] | None]] = {}
        calls = {}
        for rank, names in wanted.items():
            inline = self._inline[rank]
            held = [inline.get(n) for n in names]
            found[rank] = [None if value is None else np.array(value) for value in held]
            missing = [n for n, value in zip(names, found[rank], strict=True) if value is None]
            if missing:
                calls[rank] = self._pool.submit(self._fetch_many, rank, missing)
        for rank, call in calls.items():
            fetched = iter(call.result())
            found[rank] = [next(fetched) if value is None else value for value in found[rank]]
        return found  # type: ignore[return-value]

    def _fetch_many(self, rank: int, names: list[str]) -> list[np.ndarray[Any, Any]]:
        """One party's values in one call (FetchMany), or a plain Fetch for one value."""
        if len(names) == 1:
            return [self._fetch(rank, names[0])]
        self._flush_releases()
        party = self._party_names[rank]
        where = f"{len(names)} values fetched from party {party}"
        request = pb.FetchManyRequest(
            session=self.session, names=names, release=self._releases_for(rank)
        )
        deadline = transfer_deadline(self.timeout, sum(self._sizes.get(n, 0) for n in names))
        try:
            chunks = self._streams[rank].FetchMany(request.SerializeToString(), timeout=deadline)
            return read_tensors(chunks, pb.FetchChunk, len(names), where)
        except grpc.RpcError as exc:
            raise rpc_failure(exc, party, "FetchMany") from None

    # -- sessions -------------------------------------------------------------------------
    def _open_sessions(self) -> list[float]:
        """Open the session on every party; returns their idle timeouts."""
        request = pb.OpenSessionRequest(
            session=self.session, parties=self.spec.names, wire_version=WIRE_VERSION
        )
        calls = [stub.OpenSession.future(request, timeout=self.timeout) for stub in self._stubs]
        errors = []
        idle_timeouts = []
        for rank, call in enumerate(calls):
            try:
                reply = call.result()
            except grpc.RpcError as exc:
                errors.append(rpc_failure(exc, self._party_names[rank], "OpenSession"))
                continue
            if reply.wire_version != WIRE_VERSION:
                errors.append(
                    WireVersionError(
                        f"this driver speaks mpplug wire version {WIRE_VERSION}, but party "
                        f"{self._party_names[rank]} speaks "
                        f"{describe_version(reply.wire_version)}; run one mpplug release on "
                        f"the driver and every party"
                    )
                )
            idle_timeouts.append(reply.idle_timeout)
            self._kernels[rank] = frozenset(reply.kernels)
        if errors:
            raise errors[0]
        for rank, seconds in enumerate(idle_timeouts):
            if not seconds > 0:
                raise MPPlugError(
                    f"party {self._party_names[rank]} opened the session with idle timeout "
                    f"{seconds!r}; expected seconds > 0 (is it an older mpplug?)"
                )
        return idle_timeouts

    def _close(self) -> None:
        with self._release_lock:  # closing the session frees every value: send no releases
            self._released.clear()
            self._unreleased = [[] for _ in self._unreleased]
        self._close_session()

    # -- values ---------------------------------------------------------------------------
    def _put(self, rank: int, name: str, value: Any) -> None:
        self._flush_releases()
        value_type, array = codec.encode(value)
        header = pb.PutHeader(session=self.session, name=name, type=value_type)
        chunks = encode_chunks(header, array)
        deadline = transfer_deadline(self.timeout, array.nbytes)
        try:
            if fits_one_chunk(array.nbytes):
                self._streams[rank].PutSmall(next(chunks), timeout=deadline)
            else:
                self._streams[rank].Put(chunks, timeout=deadline)
        except grpc.RpcError as exc:
            raise rpc_failure(exc, self._party_names[rank], "Put") from None
        self._sizes[name] = array.nbytes

    def _fetch(self, rank: int, name: str) -> Any:
        self._flush_releases()
        party = self._party_names[rank]
        where = f"value {name!r} fetched from party {party}"
        request = pb.FetchRequest(session=self.session, name=name, release=self._releases_for(rank))
        deadline = transfer_deadline(self.timeout, self._sizes.get(name, 0))
        try:
            chunks = self._streams[rank].Fetch(request.SerializeToString(), timeout=deadline)
            header, parts = read_chunks(chunks, pb.FetchChunk, where)
            value = receive_tensor(codec.decode_type(header, where), parts, where)
            return codec.finish(header, value, where)
        except grpc.RpcError as exc:
            raise rpc_failure(exc, party, "Fetch") from None

    def _dataset_type(self, rank: int, name: str) -> ValueType:
        party = self._party_names[rank]
        request = pb.DatasetInfoRequest(session=self.session, name=name)
        try:
            reply = self._stubs[rank].DatasetInfo(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            if missing_of(exc) == "dataset":
                raise DatasetError(status_of(exc)[1]) from None
            raise rpc_failure(exc, party, "DatasetInfo") from None
        return codec.decode_declared_type(reply.type, f"dataset {name!r} of party {party}")

    def _release(self, names: list[str], ranks: PartySet) -> None:
        # May run in a GC finalizer on any thread: only queue (deque appends are atomic).
        self._released.append((tuple(names), ranks))

    def _releases_for(self, rank: int) -> list[str]:
        """Names `rank` may forget (at most RELEASE_MAX_NAMES), to send along with the next
        call to it."""
        with self._release_lock:
            self._sort_released()
            waiting = self._unreleased[rank]
            names, self._unreleased[rank] = (
                waiting[:RELEASE_MAX_NAMES],
                waiting[RELEASE_MAX_NAMES:],
            )
        return names

    def _flush_releases(self) -> None:
        """Send a Release (in messages of at most RELEASE_MAX_NAMES names) to every party
        with RELEASE_FLUSH or more names waiting for it."""
        with self._release_lock:
            self._sort_released()
            batches = []
            for rank, waiting in enumerate(self._unreleased):
                if len(waiting) >= RELEASE_FLUSH:
                    batches += [
                        (rank, waiting[i : i + RELEASE_MAX_NAMES])
                        for i in range(0, len(waiting), RELEASE_MAX_NAMES)
                    ]
                    self._unreleased[rank] = []
        for rank, names in batches:
            request = pb.ReleaseRequest(session=self.session, names=names)
            self._fire(self._stubs[rank].Release.future(request, timeout=self.timeout))

    def _sort_released(self) -> None:
        """Move queued dropped names to the lists of the parties holding them (lock held)."""
        while self._released:
            dropped, ranks = self._released.popleft()
            for name in dropped:
                self._sizes.pop(name, None)
            for r in ranks:
                self._unreleased[r].extend(dropped)
                for name in dropped:
                    self._inline[r].pop(name, None)

    def _fire(self, call: grpc.Future) -> None:
        """Keep an unawaited call alive until it completes (grpc cancels collected calls)."""
        self._in_flight.add(call)
        call.add_done_callback(self._in_flight.discard)

    # -- programs -------------------------------------------------------------------------
    def _ship(self, program: Program, ranks: list[int]) -> None:
        """Send the program to `ranks` in parallel; raises the first failure."""
        for sending in [self._pool.submit(self._ship_to, program, rank) for rank in ranks]:
            sending.result()

    def _ship_to(self, program: Program, rank: int) -> None:
        """Send the program to `rank` and remember it holds it; refused first if the party
        lacks a kernel the program calls."""
        missing = sorted({f.fn_type for f in program.graph.functions} - self._kernels[rank])
        if missing:
            party = self._party_names[rank]
            raise UnknownKernelError(
                f"party {party} serves no kernel for {', '.join(map(repr, missing))}, which "
                f"program {program.graph.name!r} calls; install the package that provides it "
                f"in party {party}'s environment (an entry point in the 'mpplug.kernels' "
                f"group) and restart the party; a kernel registered with @mp.kernel in the "
                f"driver's script exists only in the driver's process"
            )
        data = program.to_bytes()
        header = pb.ProgramHeader(session=self.session, digest=program.digest, size=len(data))
        chunks = encode_chunks(header, data)
        deadline = transfer_deadline(self.timeout, len(data))
        try:
            if fits_one_chunk(len(data)):
                self._streams[rank].LoadProgramSmall(next(chunks), timeout=deadline)
            else:
                self._streams[rank].LoadProgram(chunks, timeout=deadline)
        except grpc.RpcError as exc:
            raise rpc_failure(exc, self._party_names[rank], "LoadProgram") from None
        self._shipped[rank].add(program.digest)

    def _run(self, program: Program, in_names: list[str], out_names: list[str]) -> None:
        self._flush_releases()
        ranks = self._taking_part(program)
        self._ship(program, [r for r in ranks if program.digest not in self._shipped[r]])
        request = pb.ExecuteRequest(
            session=self.session,
            exec_id=uuid.uuid4().hex,
            digest=program.digest,
            inputs=in_names,
            outputs=out_names,
            timeout=self.timeout,
            profile=self._timeline is not None,
            inline_max_bytes=INLINE_MAX_BYTES,
        )
        errors = self._execute(program, request, ranks)
        if errors:
            for rank in ranks:
                for name in out_names:
                    self._inline[rank].pop(name, None)
            self._release(out_names, frozenset(range(self.world_size)))
            root = [e for _, e in sorted(errors.items()) if not isinstance(e, ExecutionAborted)]
            raise (root or list(errors.values()))[0]
        for name, (ttype, _) in zip(out_names, program.output_types, strict=True):
            self._sizes[name] = ttype.nbytes if isinstance(ttype, TensorType) else 0

    def _taking_part(self, program: Program) -> list[int]:
        """The ranks with anything to do in `program`; the others are not contacted."""
        found = self._participants.get(program.digest)
        if found is None:
            plans = [Interpreter(program.graph, r) for r in range(self.world_size)]
            found = [r for r, plan in enumerate(plans) if plan.steps or plan.input_ops]
            self._participants[program.digest] = found
        return found

    def _execute(
        self, program: Program, request: pb.ExecuteRequest, ranks: list[int]
    ) -> dict[int, MPPlugError]:
        """Run `request` on parties `ranks` at once; the errors they ended with, by rank.

        The first failure tells every party to abort; the others then get ABORT_GRACE
        seconds to report before the driver stops waiting for them.
        """
        execution = _Execution(ranks)
        for rank in ranks:
            mine = pb.ExecuteRequest(release=self._releases_for(rank))
            mine.MergeFrom(request)
            self._send_execute(_Attempt(rank, program, mine, execution))
        errors = execution.wait(ABORT_GRACE, self.execute_timeout + ABORT_GRACE)
        for rank in execution.unreported():
            stream = self._execute_streams[rank]
            if stream is not None:
                stream.forget(request.exec_id)
        silent = execution.silent()  # an execution that runs too long, or a hung party
        for rank in silent:
            errors[rank] = PartyUnavailableError(
                self._party_names[rank], f"no answer to Execute within {self.execute_timeout:g}s"
            )
        if silent:
            self._abort(request, ranks, f"no answer within {self.execute_timeout:g}s")
        return errors

    def _send_execute(self, attempt: _Attempt) -> None:
        """Send one party its share: on the party's execution stream, or as a call of its own
        if the party refused the stream."""
        attempt.start_ns = time.time_ns()
        stream = self._stream_to(attempt.rank)
        settle = functools.partial(self._settled, attempt)
        if stream is None or not stream.submit(attempt.request, settle):
            self._pool.submit(self._execute_call, attempt)

    def _stream_to(self, rank: int) -> ExecuteStream | None:
        """Party `rank`'s execution stream, opened on first use and again after it ended;
        None for STREAM_RETRY_S after the party refused one."""
        stream = self._execute_streams[rank]
        if stream is not None:
            if stream.open:
                return stream
            if stream.failure is not None:
                self._note_refusal(rank, stream.failure)
        if time.monotonic() < self._streams_refused_until[rank]:
            return None
        with self._streams_lock:
            stream = self._execute_streams[rank]
            if stream is None or not stream.open:
                stream = ExecuteStream(
                    self._streams[rank].ExecuteStream,
                    f"mpplug-driver-{self._party_names[rank]}-executions",
                )
                self._execute_streams[rank] = stream
        return stream

    def _note_refusal(self, rank: int, failure: StreamFailure) -> None:
        """After the party refused a stream, none is asked of it for STREAM_RETRY_S."""
        if failure.refused and self._streams_refused_until[rank] < time.monotonic():
            self._streams_refused_until[rank] = time.monotonic() + STREAM_RETRY_S

    def _execute_call(self, attempt: _Attempt) -> None:
        """Send one party its share as an Execute call (a blocking call on a pool thread:
        gRPC futures would start a thread per call)."""
        attempt.start_ns = time.time_ns()
        try:
            reply = self._stubs[attempt.rank].Execute(attempt.request, timeout=self.execute_timeout)
        except grpc.RpcError as exc:
            code, details = status_of(exc)
            refused = pb.Refused(code=code.name, message=details, missing=missing_of(exc) or "")
            reply = pb.ExecuteReply(refused=refused)
        self._settled(attempt, reply)

    def _settled(self, attempt: _Attempt, outcome: Outcome) -> None:
        """How one party's share ended: an error refusing the stream or naming a program the
        party lost (it restarted or evicted it) sends the share again; otherwise it is
        reported, and the execution's first failure aborts it everywhere."""
        rank, party = attempt.rank, self._party_names[attempt.rank]
        error: MPPlugError | None
        if isinstance(outcome, StreamFailure):
            if outcome.refused:  # before the party read any request: send it as a call
                self._note_refusal(rank, outcome)
                self._pool.submit(self._execute_call, attempt)
                return
            error = failure_of(outcome.code, outcome.details, None, party, "Execute")
        elif outcome.WhichOneof("outcome") == "refused":
            refused = outcome.refused
            if refused.missing == "program" and not attempt.reshipped:
                self._pool.submit(self._reship, attempt)
                return
            code = grpc.StatusCode.__members__.get(refused.code, grpc.StatusCode.UNKNOWN)
            error = failure_of(code, refused.message, refused.missing, party, "Execute")
        else:
            error = self._take_reply(rank, outcome, attempt.start_ns)
        if attempt.execution.report(rank, error):
            self._abort(attempt.request, attempt.execution.ranks, f"party {party} failed")

    def _reship(self, attempt: _Attempt) -> None:
        """Send the program again to a party that lost it, then its share once more."""
        try:
            self._ship_to(attempt.program, attempt.rank)
        except MPPlugError as exc:
            if attempt.execution.report(attempt.rank, exc):
                party = self._party_names[attempt.rank]
                self._abort(attempt.request, attempt.execution.ranks, f"party {party} failed")
            return
        attempt.reshipped = True
        self._send_execute(attempt)

    def _take_reply(self, rank: int, reply: pb.ExecuteReply, start_ns: int) -> MPPlugError | None:
        """The error a reply carries; its spans go to the timeline, its outputs to the cache."""
        party = self._party_names[rank]
        try:
            timeline = self._timeline
            if timeline is not None:
                timeline.extend(reply_spans(reply, rank, party))
                timeline.caller.add("Execute", "rpc", start_ns, party=rank)
            self._inline[rank].update(inline_values(reply, party))
        except MPPlugError as exc:
            return exc
        return reply_error(reply, party)

    def _abort(self, request: pb.ExecuteRequest, ranks: Iterable[int], reason: str) -> None:
        abort = pb.AbortRequest(session=self.session, exec_id=request.exec_id, reason=reason)
        for rank in ranks:
            self._fire(self._stubs[rank].Abort.future(abort, timeout=self.timeout))

    def __repr__(self) -> str:
        endpoints = ", ".join(f"{p.name}@{p.endpoint}" for p in self.spec.parties)
        return f"Driver({endpoints})"


def _keep_alive(
    stubs: Sequence[rpc_pb.PartyServiceStub],
    request: pb.KeepAliveRequest,
    every: float,
    timeout: float,
    stop: threading.Event,
) -> None:
    """Renew the session on every party each `every` seconds until `stop` is set."""
    while not stop.wait(every):
        calls = [stub.KeepAlive.future(request, timeout=timeout) for stub in stubs]
        for call in calls:
            _settle(call)  # a party that lost the session says so on the driver's next call


def _shut_down(
    stubs: Sequence[rpc_pb.PartyServiceStub],
    session: str,
    timeout: float,
    stop_keepalive: threading.Event,
    pool: ThreadPoolExecutor,
    channels: Sequence[grpc.Channel],
    execute_streams: Sequence[ExecuteStream | None],
) -> None:
    """Stop the keepalive, end the execution streams, close the session on every party (best
    effort: a party that is down has dropped it, one that does not answer drops it when its
    lease runs out) and close the channels."""
    stop_keepalive.set()
    for stream in execute_streams:
        if stream is not None:
            stream.close()
    request = pb.CloseSessionRequest(session=session)
    for call in [stub.CloseSession.future(request, timeout=timeout) for stub in stubs]:
        _settle(call)
    pool.shutdown(wait=False, cancel_futures=True)
    for channel in channels:
        channel.close()


def _settle(call: grpc.Future) -> None:
    """Wait for a call whose outcome does not matter."""
    with contextlib.suppress(grpc.FutureCancelledError):
        call.exception()


@dataclass
class _Attempt:
    """One party's share of an execution, as sent to it."""

    rank: int
    program: Program
    request: pb.ExecuteRequest
    execution: _Execution
    reshipped: bool = False
    start_ns: int = 0


class _Execution:
    """The outcomes of one execution as the parties report them."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self._pending = set(ranks)
        self._errors: dict[int, MPPlugError] = {}
        self._failed_at: float | None = None
        self._cond = threading.Condition()

    def report(self, rank: int, error: MPPlugError | None) -> bool:
        """Record how `rank` ended; True for the execution's first failure."""
        with self._cond:
            self._pending.discard(rank)
            first = error is not None and self._failed_at is None
            if error is not None:
                self._errors[rank] = error
                if first:
                    self._failed_at = time.monotonic()
            self._cond.notify_all()
        return first

    def wait(self, grace: float, limit: float) -> dict[int, MPPlugError]:
        """Wait for every party, but only `grace` seconds after the first failure and at most
        `limit` seconds in all."""
        give_up = time.monotonic() + limit
        with self._cond:
            while self._pending:
                if self._failed_at is not None:
                    give_up = min(give_up, self._failed_at + grace)
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return dict(self._errors)

    def unreported(self) -> list[int]:
        """The ranks that have not reported."""
        with self._cond:
            return sorted(self._pending)

    def silent(self) -> list[int]:
        """The ranks that have not reported, if no rank failed."""
        with self._cond:
            return sorted(self._pending) if self._failed_at is None else []
