"""gRPC channels and server options shared by drivers and parties.

Message limits match the chunking, keepalive finds dead peers within a fraction of the timeout,
reconnects back off for at most a second while one connection attempt may take 20 s, and TLS
is used whenever the cluster has it.
"""

from __future__ import annotations

from typing import Any

import grpc

from mpplug.remote.streaming import MAX_MESSAGE_BYTES

MIN_PING_INTERVAL_MS = 500
CONNECT_TIMEOUT_MS = 20_000
"""How long one connection attempt (TCP, TLS handshake, HTTP/2 settings) may take. gRPC core
reads it from `grpc.min_reconnect_backoff_ms`, which despite its name is no backoff: set to
100 ms, every handshake over a link with 100 ms round trips, or with a busy party, was cut
short and the call refused as unavailable (grpc/grpc#12830, #33423). 20 s is gRPC's default;
a call's own deadline still bounds it."""


def keepalive_for(timeout: float) -> float:
    """Seconds between keepalive pings (and to wait for their ack) for a cluster timeout:
    a quarter of it, between 1 and 30, so a silent peer is noticed well within the timeout."""
    return min(max(timeout / 4, 1.0), 30.0)


def channel_options(keepalive_s: float) -> list[tuple[str, Any]]:
    keepalive_ms = int(keepalive_s * 1000)
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms),
        # grpcio waits this long (default 60 s) for a keepalive ping's ack; keepalive_timeout
        # alone does not bound it, so a stopped party (whose kernel still ACKs TCP) goes unseen.
        ("grpc.http2.ping_timeout_ms", keepalive_ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
        ("grpc.enable_http_proxy", 0),
    ]


def server_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


def open_channel(
    endpoint: str, credentials: grpc.ChannelCredentials | None, keepalive_s: float
) -> grpc.Channel:
    """A channel to `endpoint`, with mutual TLS when `credentials` (tls.channel_credentials)
    are given."""
    options = channel_options(keepalive_s)
    if credentials is None:
        return grpc.insecure_channel(endpoint, options=options)
    return grpc.secure_channel(endpoint, credentials, options=options)
