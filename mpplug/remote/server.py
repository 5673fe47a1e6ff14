"""`PartyServer`: one party of a cluster as a gRPC server, and `python -m mpplug.remote.server`.

It serves PartyService to drivers, PeerService to the other parties and the standard
grpc.health.v1 service, with mutual TLS when the cluster file has TLS paths, and takes large
values from the other parties on its bulk port when it has one. A background
upkeep closes idle sessions, drops values nobody will receive and cancels stalled streams.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2

from mpplug.config import ClusterSpec, ServerLimits, is_loopback, split_endpoint
from mpplug.core.custom_calls import CustomCallPolicy
from mpplug.core.memory import numpy_huge_pages
from mpplug.errors import ConfigError, MPPlugError
from mpplug.kernels.datasets import Datasets
from mpplug.kernels.jax_exec import start_module_check
from mpplug.protos import service_pb2
from mpplug.remote.bulk import Listener
from mpplug.remote.channels import server_options
from mpplug.remote.limits import Slots, StreamWatch
from mpplug.remote.peer import PeerCommunicator, PeerServicer
from mpplug.remote.rpc import add_service
from mpplug.remote.service import PartyServicer
from mpplug.remote.session import DEFAULT_IDLE_TIMEOUT
from mpplug.remote.tls import server_credentials
from mpplug.runtime.communicator import Mailbox
from mpplug.runtime.party import Party

log = logging.getLogger(__name__)

SERVICES = service_pb2.DESCRIPTOR.services_by_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]

UPKEEP_MAX_S = 1.0
"""The longest the upkeep sleeps between rounds (shorter when a limit is shorter)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
KEPT_BLOCK_BYTES = 32 << 20
"""The largest freed block a party keeps for reuse (glibc's ceiling for the mmap threshold)."""


class HealthServicer(health.HealthServicer):
    """grpc's health service with List answered: grpcio-health-checking leaves List to the
    generated base class, which answers UNIMPLEMENTED and logs a traceback on every call."""

    def List(
        self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthListResponse:
        with self._lock:
            statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in statuses.items()
            }
        )


class PartyServer:
    """Party `party` of `spec`, listening on its `listen` address.

    `timeout` bounds sends to peers (plus time for the bytes) and sets keepalive on peer
    channels. A session no call names for `session_idle_timeout` seconds is closed with its
    values. `limits` (default: the cluster file's) caps what callers may hold at once (see
    ServerLimits). TLS files and the party's data files are read and checked here: a bad one
    is a ConfigError naming it.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        party: str,
        *,
        timeout: float = 60.0,
        session_idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        limits: ServerLimits | None = None,
    ) -> None:
        if not (session_idle_timeout > 0 and math.isfinite(session_idle_timeout)):
            raise ConfigError(
                f"session idle timeout: expected seconds > 0, got {session_idle_timeout!r}"
            )
        self.spec = spec
        self.party = spec.party(party)
        self.rank = spec.rank_of(self.party.name)
        self.timeout = timeout
        self.session_idle_timeout = session_idle_timeout
        self.limits = limits if limits is not None else spec.limits
        tls = self.party.tls
        self._credentials = server_credentials(tls) if tls is not None else None
        self._mailbox = Mailbox(
            self.rank,
            max_pending_bytes=self.limits.pending_bytes_per_peer,
            unclaimed_ttl=self.limits.unclaimed_value_s,
        )
        self._comm = PeerCommunicator(spec, self.rank, self._mailbox, tls=tls, timeout=timeout)
        # Programs are exported for the platform of each party's declared device, cpu by default.
        device = self.party.device or "cpu"
        datasets = Datasets(self.party.name, self.party.data, self.party.outputs)
        self._party = Party(
            self.rank,
            spec.world_size,
            self._comm,
            device=device,
            datasets=datasets,
            untrusted_artifacts=True,  # programs come from the network
            custom_calls=self.party.custom_calls,
        )
        self._watch = StreamWatch(self.limits.stream_idle_s)
        self._service = PartyServicer(
            spec,
            self._party,
            self._mailbox,
            self._comm,
            limits=self.limits,
            watch=self._watch,
            session_idle_timeout=session_idle_timeout,
        )
        self._health = HealthServicer()
        self._peer_service = PeerServicer(
            spec,
            self.rank,
            self._mailbox,
            slots=Slots("value streams from peers", self.limits.peer_streams),
            watch=self._watch,
        )
        self._bulk: Listener | None = None
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._stopped = threading.Event()
        self._upkeep: threading.Thread | None = None
        self._trim: Callable[[], object] | None = None
        self._begun_seen = -1

    @property
    def port(self) -> int:
        """The port the server is bound to."""
        if self._port is None:
            raise MPPlugError(f"party {self.party.name} is not started")
        return self._port

    def start(self) -> None:
        limits = self.limits
        server = grpc.server(
            ThreadPoolExecutor(limits.workers, thread_name_prefix=f"mpplug-{self.party.name}"),
            options=server_options(),
            maximum_concurrent_rpcs=limits.max_rpcs,
        )
        # Binding is the last step that can fail: a failed start holds no port (a bound,
        # unstarted gRPC server would keep its port until the process exits).
        bulk = self._listen_bulk()
        try:
            port = self._bind(server)
        except BaseException:
            if bulk is not None:
                bulk.stop()
            raise
        server.start()
        if bulk is not None:
            bulk.start()
        start_module_check()  # its helper starts now, not on the first program's clock
        self._bulk = bulk
        for name in ("", *(service.full_name for service in SERVICES.values())):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self._port = server, port
        self._upkeep = threading.Thread(
            target=self._keep_up, name=f"mpplug-{self.party.name}-upkeep", daemon=True
        )
        self._upkeep.start()
        log.info(
            "party %s (rank %d of %d) serving on %s%s; idle sessions close after %gs",
            self.party.name,
            self.rank,
            self.spec.world_size,
            self.party.listen,
            " with mutual TLS" if self.party.tls else "",
            self.session_idle_timeout,
        )

    def _listen_bulk(self) -> Listener | None:
        """The bulk listener (bound, not started) if the party has a bulk port."""
        address = self.party.bulk_listen
        if address is None:
            return None
        try:
            return Listener(
                address,
                self._peer_service,
                tls=self.party.tls,
                connections=self.limits.bulk_connections,
                stall_s=self.limits.stream_idle_s,
                name=self.party.name,
            )
        except OSError as exc:
            raise ConfigError(
                f"party {self.party.name}: cannot listen for bulk values on "
                f"{address[0]}:{address[1]}: {exc.strerror or exc}"
            ) from None

    def _bind(self, server: grpc.Server) -> int:
        """Register the services and bind the listen address; returns the port. TLS
        credentials were read and checked in __init__."""
        peer_service = self._peer_service
        add_service(
            server,
            self._service,
            SERVICES["PartyService"],
            self._service.RAW_REQUESTS,
            admit=self._service.admit,
        )
        add_service(server, peer_service, SERVICES["PeerService"], peer_service.RAW_REQUESTS)
        # Registered like our services, so undecodable bytes are INVALID_ARGUMENT, not the
        # INTERNAL that gRPC's generated handler answers when its deserializer fails.
        add_service(server, self._health, HEALTH)
        listen = self.party.listen
        try:
            if self._credentials is None:
                port = server.add_insecure_port(listen)
            else:
                port = server.add_secure_port(listen, self._credentials)
        except RuntimeError as exc:
            raise ConfigError(
                f"party {self.party.name}: cannot listen on {listen}: {exc}"
            ) from None
        if port == 0:
            raise ConfigError(f"party {self.party.name}: cannot listen on {listen}")
        return port

    def trim_when_idle(self, trim: Callable[[], object]) -> None:
        """Call `trim` (see keep_chunk_memory) at each upkeep round that finds no execution
        begun since the last one and none running: memory kept for reuse goes back to the
        system once the party is idle."""
        self._trim = trim

    def _keep_up(self) -> None:
        """Until the server stops: close idle sessions, drop values for executions that never
        started here, cancel streams that stalled, and give back memory when idle."""
        shortest = min(
            self.session_idle_timeout, self.limits.unclaimed_value_s, self.limits.stream_idle_s
        )
        pause = min(shortest / 4, UPKEEP_MAX_S)
        while not self._stopped.wait(pause):
            self._service.expire_sessions()
            dropped = self._mailbox.expire()
            if dropped:
                log.info(
                    "party %s: dropped %d value(s) for executions that never started here",
                    self.party.name,
                    dropped,
                )
            begun, running = self._service.activity()
            if self._trim is not None and begun == self._begun_seen and not running:
                self._trim()
            self._begun_seen = begun
            stalled = self._watch.sweep()
            if stalled:
                log.info(
                    "party %s: cancelled %d stream(s) idle for over %gs",
                    self.party.name,
                    stalled,
                    self._watch.idle_s,
                )

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: health turns NOT_SERVING, execution streams take no more requests
        and end once theirs have replied, and running calls get `grace` seconds."""
        if self._server is None:
            return
        self._health.enter_graceful_shutdown()
        self._service.drain()
        self._server.stop(grace).wait()
        if self._bulk is not None:
            self._bulk.stop()
        self._service.close()
        self._party.close()
        self._comm.close()
        self._stopped.set()
        if self._upkeep is not None:
            self._upkeep.join()

    def wait(self) -> None:
        """Block until the server stops."""
        self._stopped.wait()

    def __repr__(self) -> str:
        return f"PartyServer({self.party.name}, rank {self.rank}, listen {self.party.listen})"


def keep_chunk_memory() -> Callable[[], object] | None:
    """Receiving a value allocates a buffer of its size (and, over gRPC, a megabyte per chunk
    on the way). glibc's malloc maps blocks over 128 KiB fresh for each allocation and faults
    their pages in anew, which can cost as much as moving the bytes; keep freed blocks of up
    to KEPT_BLOCK_BYTES in the heap for reuse instead. Returns glibc's malloc_trim(0), which
    gives such kept memory back (PartyServer.trim_when_idle). Process-wide, so only the party
    commands call it; a no-op (None) where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt(_M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)
    mallopt(_M_TRIM_THRESHOLD, 2 * KEPT_BLOCK_BYTES)
    return lambda: malloc_trim(0)


NUMPY_HUGEPAGE_ENV = "NUMPY_MADVISE_HUGEPAGE"


def plain_pages_for_numpy() -> bool:
    """Stop NumPy advising the kernel to back its arrays of 4 MiB and more with huge pages,
    unless `NUMPY_MADVISE_HUGEPAGE` says otherwise: on a virtual machine that hands freed
    memory back to its host they fault in slowly (`mpplug.core.memory`; a party's interpreted
    runs make such arrays; a 2 GiB value's trip driver -> party -> party -> driver took 69 s
    with them, 11 s with NumPy's advice off in every process). Returns whether it changed
    NumPy's setting. Process-wide, so only the party commands call it (a user who sets the
    variable keeps NumPy's choice)."""
    if NUMPY_HUGEPAGE_ENV in os.environ:
        return False
    return bool(numpy_huge_pages(False))


SIGNAL_POLL_S = 0.5
"""How often the main thread wakes while serving (signal handlers also wake it at once)."""


def serve_forever(server: PartyServer, parent_pid: int | None = None) -> int:
    """Start `server` and serve in the foreground until SIGTERM or SIGINT, or until the
    process `parent_pid` (if given) is gone; returns 0 after a clean shutdown. Errors
    starting it (ConfigError) propagate. For the main thread only."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    name = server.party.name
    stop_requested = threading.Event()

    def shut_down(signum: int, frame: FrameType | None) -> None:
        log.info("party %s: %s, shutting down", name, signal.Signals(signum).name)
        stop_requested.set()

    # Handlers first: a signal that arrives while the server starts still stops it cleanly.
    signal.signal(signal.SIGTERM, shut_down)
    signal.signal(signal.SIGINT, shut_down)
    server.start()  # first: a party that cannot start says only why
    if plain_pages_for_numpy():
        log.info("party %s: NumPy's huge-page advice off (%s unset)", name, NUMPY_HUGEPAGE_ENV)
    trim = keep_chunk_memory()
    if trim is not None:
        server.trim_when_idle(trim)
    while not stop_requested.wait(SIGNAL_POLL_S):
        if parent_pid is not None and os.getppid() != parent_pid:
            log.info("party %s: process %d that started it is gone, stopping", name, parent_pid)
            break
    server.stop()
    return 0


def check_exposure(spec: ClusterSpec, party: str, *, insecure: bool) -> None:
    """Without TLS anyone who reaches a party's port can act as the driver or as any party, so
    a party without TLS may listen beyond loopback only when `insecure` says so."""
    spec_of = spec.party(party)
    if spec.tls or insecure or is_loopback(split_endpoint(spec_of.listen, "listen")[0]):
        return
    raise ConfigError(
        f"party {party} would listen on {spec_of.listen} without TLS, where any host that "
        f"reaches the port could act as the driver or as any party. Add tls blocks to the "
        f"cluster file (`mpplug certs` writes them), listen on a loopback address, or pass "
        f"--insecure to accept that"
    )


def serve_party(
    config: str | Path,
    party: str,
    *,
    timeout: float,
    session_idle_timeout: float,
    limits: Sequence[str] = (),
    insecure: bool = False,
    parent_pid: int | None = None,
    custom_calls: str | None = None,
) -> int:
    """Serve `party` of the cluster file `config` until SIGTERM or SIGINT (exit code 0), or
    until the process `parent_pid` is gone. `limits` are NAME=VALUE assignments over the
    file's; see `check_exposure` for `insecure`. `custom_calls` (comma-separated entries)
    replaces the party's custom-call policy from the file.

    Only this party's TLS files need exist on this host; a bad file or an unknown party is a
    ConfigError.
    """
    spec = ClusterSpec.from_yaml(config, files_of=[party])
    if party not in spec.names:
        raise ConfigError(f"{config}: no party named {party!r}; parties: {spec.names}")
    check_exposure(spec, party, insecure=insecure)
    if custom_calls is not None:
        try:
            policy = CustomCallPolicy.parse(custom_calls, "--custom-calls")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        parties = [
            dataclasses.replace(p, custom_calls=policy) if p.name == party else p
            for p in spec.parties
        ]
        spec = dataclasses.replace(spec, parties=tuple(parties))
    server = PartyServer(
        spec,
        party,
        timeout=timeout,
        session_idle_timeout=session_idle_timeout,
        limits=spec.limits.overridden(limits, "--limit"),
    )
    return serve_forever(server, parent_pid)


def main(argv: list[str] | None = None) -> int:
    """`python -m mpplug.remote.server ...` is `mpplug serve ...`."""
    from mpplug import cli

    return cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
