"""Mutual TLS for every channel of a cluster: credentials from PEM files, and who a caller is.

Servers require a client certificate signed by the cluster CA; a certificate's CN is the party name.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.errors import ConfigError

DRIVER_CERT = "driver.pem"
DRIVER_KEY = "driver.key"


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS {what} {path}: {exc.strerror}") from None


def server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    """Serve with `files.cert`; accept only clients with a certificate signed by `files.ca`."""
    return grpc.ssl_server_credentials(
        [(_read(files.key, "key"), _read(files.cert, "certificate"))],
        root_certificates=_read(files.ca, "CA certificate"),
        require_client_auth=True,
    )


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """Dial with `files.cert` as our identity; trust only servers signed by `files.ca`."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca, "CA certificate"),
        private_key=_read(files.key, "key"),
        certificate_chain=_read(files.cert, "certificate"),
    )


def peer_common_name(context: grpc.ServicerContext) -> str | None:
    """The CN of the caller's verified certificate, or None on an insecure channel."""
    names = context.auth_context().get("x509_common_name")
    return names[0].decode() if names else None


def driver_tls(spec: ClusterSpec, tls: TLSFiles | None) -> TLSFiles | None:
    """The files a driver dials with: `tls` if given, else driver.pem and driver.key next to
    the cluster CA (as `mpplug certs` writes them); None when the cluster has no TLS."""
    if not spec.tls:
        if tls is not None:
            raise ConfigError("a driver certificate was given, but the cluster file has no tls")
        return None
    if tls is not None:
        return tls
    ca = spec.parties[0].tls.ca  # type: ignore[union-attr]
    cert, key = ca.parent / DRIVER_CERT, ca.parent / DRIVER_KEY
    if not (cert.is_file() and key.is_file()):
        raise ConfigError(
            f"the cluster uses TLS, so the driver needs a client certificate: expected "
            f"{DRIVER_CERT} and {DRIVER_KEY} next to {ca}, or pass tls=TLSFiles(...) "
            f"(`mpplug certs` writes them)"
        )
    return TLSFiles(ca, cert, key)
