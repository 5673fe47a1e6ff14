"""Mutual TLS for every channel of a cluster: credentials from PEM files, and who a caller is.

Servers require a client certificate signed by the cluster CA; a certificate's CN is the party name.
The PEM files are checked when credentials are made, so a bad file stops a party or driver at
start with an error naming it, not at its first connection.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.errors import ConfigError

DRIVER_CERT = "driver.pem"
DRIVER_KEY = "driver.key"


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS {what} {path}: {exc.strerror}") from None


def _certificates(path: Path, what: str) -> tuple[bytes, x509.Certificate]:
    """The PEM bytes of `path` and the first certificate in it."""
    data = _read(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(
            f"TLS {what} {path}: expected PEM certificates, got a file that does not parse "
            f"as one ({exc})"
        ) from None
    return data, certs[0]


def _key(path: Path, cert: x509.Certificate, cert_path: Path) -> bytes:
    """The PEM bytes of `path`, checked to be the unencrypted private key of `cert`."""
    data = _read(path, "key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"TLS key {path}: expected an unencrypted PEM private key, got a file that does "
            f"not load as one ({exc})"
        ) from None
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(der, spki) != cert.public_key().public_bytes(der, spki):
        raise ConfigError(f"TLS key {path} is not the key of certificate {cert_path}")
    return data


def _load(files: TLSFiles) -> tuple[bytes, bytes, bytes]:
    """The CA, certificate and key PEM bytes of `files`, each checked."""
    ca = _certificates(files.ca, "CA certificate")[0]
    cert, leaf = _certificates(files.cert, "certificate")
    return ca, cert, _key(files.key, leaf, files.cert)


def server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    """Serve with `files.cert`; accept only clients with a certificate signed by `files.ca`."""
    ca, cert, key = _load(files)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """Dial with `files.cert` as our identity; trust only servers signed by `files.ca`."""
    ca, cert, key = _load(files)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
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
