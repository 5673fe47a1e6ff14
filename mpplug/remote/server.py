"""`PartyServer`: one party of a cluster as a gRPC server, and `python -m mpplug.remote.server`.

It serves PartyService to drivers, PeerService to the other parties and the standard
grpc.health.v1 service, with mutual TLS when the cluster file has TLS paths.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mpplug.config import ClusterSpec
from mpplug.errors import ConfigError, MPPlugError
from mpplug.protos import service_pb2
from mpplug.remote.channels import server_options
from mpplug.remote.peer import PeerCommunicator, PeerServicer
from mpplug.remote.rpc import add_service
from mpplug.remote.service import PartyServicer
from mpplug.remote.streaming import CHUNK_BYTES
from mpplug.remote.tls import server_credentials
from mpplug.runtime.communicator import Mailbox
from mpplug.runtime.party import Party

log = logging.getLogger(__name__)

MAX_WORKERS = 64
"""Threads serving RPCs: executions, incoming peer values and driver calls run at once."""

SERVICES = service_pb2.DESCRIPTOR.services_by_name

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


class PartyServer:
    """Party `party` of `spec`, listening on its `listen` address.

    `timeout` bounds sends to peers (plus time for the bytes) and sets keepalive on peer channels.
    """

    def __init__(self, spec: ClusterSpec, party: str, *, timeout: float = 60.0) -> None:
        self.spec = spec
        self.party = spec.party(party)
        self.rank = spec.rank_of(self.party.name)
        self.timeout = timeout
        self._mailbox = Mailbox(self.rank)
        self._comm = PeerCommunicator(
            spec, self.rank, self._mailbox, tls=self.party.tls, timeout=timeout
        )
        # Programs are exported for the platform of each party's declared device, cpu by default.
        device = self.party.device or "cpu"
        self._party = Party(self.rank, spec.world_size, self._comm, device=device)
        self._health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._stopped = threading.Event()

    @property
    def port(self) -> int:
        """The port the server is bound to."""
        if self._port is None:
            raise MPPlugError(f"party {self.party.name} is not started")
        return self._port

    def start(self) -> None:
        server = grpc.server(
            ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix=f"mpplug-{self.party.name}"),
            options=server_options(),
        )
        party_service = PartyServicer(self.spec, self._party, self._mailbox)
        peer_service = PeerServicer(self.spec, self.rank, self._mailbox)
        add_service(server, party_service, SERVICES["PartyService"], party_service.RAW_REQUESTS)
        add_service(server, peer_service, SERVICES["PeerService"], peer_service.RAW_REQUESTS)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        listen = self.party.listen
        try:
            if self.party.tls is None:
                port = server.add_insecure_port(listen)
            else:
                port = server.add_secure_port(listen, server_credentials(self.party.tls))
        except RuntimeError as exc:
            raise ConfigError(
                f"party {self.party.name}: cannot listen on {listen}: {exc}"
            ) from None
        if port == 0:
            raise ConfigError(f"party {self.party.name}: cannot listen on {listen}")
        server.start()
        for name in ("", *(service.full_name for service in SERVICES.values())):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self._port = server, port
        log.info(
            "party %s (rank %d of %d) serving on %s%s",
            self.party.name,
            self.rank,
            self.spec.world_size,
            listen,
            " with mutual TLS" if self.party.tls else "",
        )

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: health turns NOT_SERVING, running calls get `grace` seconds."""
        if self._server is None:
            return
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self._comm.close()
        self._stopped.set()

    def wait(self) -> None:
        """Block until the server stops."""
        self._stopped.wait()

    def __repr__(self) -> str:
        return f"PartyServer({self.party.name}, rank {self.rank}, listen {self.party.listen})"


def keep_chunk_memory() -> None:
    """Receiving a value allocates about a megabyte per chunk. glibc's malloc hands such
    blocks back to the OS when freed and faults fresh pages in for the next one, which can
    cost more than the transfer itself; keep them in the heap for reuse instead. Process-wide,
    so only the party command calls it; a no-op where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 4 * CHUNK_BYTES)
    mallopt(_M_TRIM_THRESHOLD, 64 * CHUNK_BYTES)


def main(argv: list[str] | None = None) -> int:
    """Run one party in the foreground until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m mpplug.remote.server", description="Run one party of a cluster."
    )
    parser.add_argument("--config", required=True, help="the cluster file (YAML)")
    parser.add_argument("--party", required=True, help="which party of the file to run")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a send to a peer may wait"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    keep_chunk_memory()
    try:
        spec = ClusterSpec.from_yaml(args.config, files_of=[args.party])
        server = PartyServer(spec, args.party, timeout=args.timeout)
        server.start()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def shut_down(signum: int, frame: FrameType | None) -> None:
        log.info("party %s: %s, shutting down", args.party, signal.Signals(signum).name)
        threading.Thread(target=server.stop, name="mpplug-shutdown").start()

    signal.signal(signal.SIGTERM, shut_down)
    signal.signal(signal.SIGINT, shut_down)
    server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
