"""Asking a party how it is: the standard health check plus the party's Status call.

`query_status` never raises for an unreachable party; it reports it as "UNREACHABLE".
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.channels import open_channel
from mpplug.remote.rpc import status_of
from mpplug.remote.tls import channel_credentials
from mpplug.runtime.codec import decode_declared_type

UNREACHABLE = "UNREACHABLE"


@dataclass(frozen=True)
class PartyStatus:
    """What a party said about itself: `health` is a grpc.health.v1 status name
    ("SERVING", "NOT_SERVING", ...) or "UNREACHABLE"; `sessions` is None when unknown;
    `datasets` are what programs may read there (metadata only)."""

    name: str
    endpoint: str
    health: str
    sessions: int | None
    detail: str
    datasets: tuple[tuple[str, str], ...] = ()
    """(name, type such as "f32[3,4]") for each dataset the party exposes."""

    @property
    def serving(self) -> bool:
        return self.health == "SERVING"


def query_status(
    spec: ClusterSpec, party: str, timeout: float = 2.0, *, tls: TLSFiles | None = None
) -> PartyStatus:
    """Check `party` of `spec`; with TLS the client presents `tls`, else the party's own files
    (a ConfigError if they cannot be read)."""
    target = spec.party(party)
    files = tls if tls is not None else target.tls
    credentials = channel_credentials(files) if files is not None else None
    with open_channel(target.endpoint, credentials, keepalive_s=max(timeout, 1.0)) as channel:
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
            state = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                return PartyStatus(target.name, target.endpoint, state, None, "not serving")
            status = rpc_pb.PartyServiceStub(channel).Status(pb.StatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code, details = status_of(exc)
            return PartyStatus(
                target.name, target.endpoint, UNREACHABLE, None, f"{code.name}: {details}"
            )
    detail = (
        f"rank {status.rank} of {status.world_size}, {status.sessions} session(s), "
        f"up {status.uptime_s:.0f}s"
    )
    datasets = tuple(
        (d.name, str(decode_declared_type(d.type, f"dataset {d.name!r} of party {target.name}")))
        for d in status.datasets
    )
    return PartyStatus(target.name, target.endpoint, state, status.sessions, detail, datasets)
