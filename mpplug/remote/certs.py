"""Development certificates for mutual TLS: a cluster CA, one certificate per party and one
for the driver, written as PEM files (what `mpplug certs` produces).

Each party's certificate has CN = party name and its host names and IPs as subject alternative
names; it serves as both server and client certificate. Keys are ECDSA P-256.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mpplug.config import ClusterSpec, PartySpec, TLSFiles, is_loopback, split_endpoint
from mpplug.errors import ConfigError
from mpplug.remote.tls import DRIVER_CERT, DRIVER_KEY

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
DRIVER = "driver"
VALID_DAYS = 365
_WILDCARDS = {"", "0.0.0.0", "::", "*"}
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def write_dev_certs(spec: ClusterSpec, out_dir: Path) -> dict[str, TLSFiles]:
    """Write ca.pem/ca.key, <party>.pem/<party>.key for each party and driver.pem/driver.key
    into `out_dir`; returns the files by party name, plus "driver" for the driver's."""
    for party in spec.parties:
        if party.name in (DRIVER, Path(CA_CERT).stem):
            raise ConfigError(
                f"party name {party.name!r} would overwrite the {party.name} certificate files; "
                f"rename the party"
            )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mpplug development CA")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = out_dir / CA_CERT
    _write(ca_path, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out_dir / CA_KEY, ca_key)

    files: dict[str, TLSFiles] = {}
    hosts_of = {p.name: _hosts(p) for p in spec.parties}
    if any(is_loopback(h) for hosts in hosts_of.values() for h in hosts):
        hosts_of = {name: [*hosts, *_LOOPBACK_NAMES] for name, hosts in hosts_of.items()}
    for name, hosts in [*hosts_of.items(), (DRIVER, list(_LOOPBACK_NAMES))]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _leaf(name, hosts, key.public_key(), ca_cert, ca_key)
        cert_path = out_dir / (DRIVER_CERT if name == DRIVER else f"{name}.pem")
        key_path = out_dir / (DRIVER_KEY if name == DRIVER else f"{name}.key")
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        files[name] = TLSFiles(ca_path, cert_path, key_path)
    return files


def with_tls(spec: ClusterSpec, files: Mapping[str, TLSFiles]) -> ClusterSpec:
    """`spec` with each party's TLS files taken from `files` (as `write_dev_certs` returns)."""
    missing = [name for name in spec.names if name not in files]
    if missing:
        raise ConfigError(f"no TLS files for parties {missing}")
    data = spec.to_dict()
    for entry in data["parties"]:
        tls = files[entry["name"]]
        entry["tls"] = {"ca": str(tls.ca), "cert": str(tls.cert), "key": str(tls.key)}
    return ClusterSpec.from_dict(data, source="with_tls")


def _hosts(party: PartySpec) -> list[str]:
    """The endpoint host, and the listen host when it differs and is not a wildcard."""
    hosts = [party.host]
    listen = split_endpoint(party.listen, f"party {party.name} listen")[0]
    if listen not in _WILDCARDS and listen not in hosts:
        hosts.append(listen)
    return hosts


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _leaf(
    name: str,
    hosts: list[str],
    public_key: ec.EllipticCurvePublicKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        _builder(subject, ca_cert.subject, public_key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(hosts), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
