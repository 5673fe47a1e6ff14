"""Mutual TLS: development certificates, the conformance suite with TLS on every channel, and
clients without a certificate signed by the cluster CA refused.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import mpplug as mp
from mpplug.config import ClusterSpec
from mpplug.core import DType, TensorType
from mpplug.core.serde import tensor_type_to_proto
from mpplug.errors import ConfigError
from mpplug.remote.certs import with_tls, write_dev_certs
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.server import PartyServer
from mpplug.remote.status import query_status

from . import test_conformance
from .clusters import POOL, driver_tls_cluster

TIMEOUT = 20.0
F32 = tensor_type_to_proto(TensorType(DType.FLOAT32, ()))


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., mp.Cluster]]:
    """Every cluster of the conformance tests below runs with mutual TLS."""
    with contextlib.ExitStack() as stack:

        def make(world_size: int, timeout: float = TIMEOUT) -> mp.Cluster:
            return stack.enter_context(driver_tls_cluster(world_size, timeout))

        yield make


# The conformance suite once more, against parties that speak only mutual TLS.
globals().update(
    {name: test for name, test in vars(test_conformance).items() if name.startswith("test_")}
)


@pytest.fixture
def tls_parties() -> LocalParties:
    return POOL.get(2, tls=True)


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(path: Path) -> x509.SubjectAlternativeName:
    return _load(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_dev_certs_name_each_party_and_its_hosts(tmp_path):
    spec = ClusterSpec.from_dict(
        {
            "parties": [
                {"name": "alice", "endpoint": "127.0.0.1:7001", "listen": "0.0.0.0:7001"},
                {"name": "bob", "endpoint": "bob.internal:7002", "listen": "10.0.0.2:7002"},
            ]
        }
    )
    files = write_dev_certs(spec, tmp_path)
    assert sorted(files) == ["alice", "bob", "driver"]
    ca = _load(tmp_path / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, tls in files.items():
        cert = _load(tls.cert)
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
        assert tls.key.stat().st_mode & 0o777 == 0o600
        assert tls.ca == tmp_path / "ca.pem"
    sans = {name: _sans(files[name].cert) for name in ("alice", "bob")}
    alice_ips = sans["alice"].get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("127.0.0.1") in alice_ips
    assert "localhost" in sans["alice"].get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("0.0.0.0") not in alice_ips  # a wildcard is no host name
    assert "bob.internal" in sans["bob"].get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("10.0.0.2") in sans["bob"].get_values_for_type(x509.IPAddress)


def test_dev_certs_refuse_a_party_named_like_their_files(tmp_path):
    spec = ClusterSpec.from_dict({"parties": [{"name": "driver", "endpoint": "127.0.0.1:7001"}]})
    with pytest.raises(ConfigError, match="party name 'driver' would overwrite"):
        write_dev_certs(spec, tmp_path)


def test_the_driver_needs_a_certificate_when_the_cluster_uses_tls(tmp_path):
    spec = ClusterSpec.local(2)
    files = write_dev_certs(spec, tmp_path)
    files["driver"].cert.unlink()
    with pytest.raises(ConfigError, match=r"needs a client certificate: expected driver\.pem"):
        Driver(with_tls(spec, files))
    with pytest.raises(ConfigError, match="the cluster file has no tls"):
        Driver(spec, tls=files["P0"])


def test_status_and_health_work_over_tls(tls_parties):
    status = query_status(tls_parties.spec, "P1")
    assert status.serving and "rank 1 of 2" in status.detail


def test_bad_pem_files_stop_a_party_or_driver_at_start_naming_the_file(tmp_path):
    spec = ClusterSpec.local(2)
    files = write_dev_certs(spec, tmp_path)
    spec = with_tls(spec, files)
    p0 = files["P0"]
    original = {path: path.read_bytes() for path in (p0.ca, p0.cert, p0.key)}
    cases = [
        (p0.key, b"not a key", rf"TLS key {p0.key}: expected an unencrypted PEM private key"),
        (p0.key, files["P1"].key.read_bytes(), rf"TLS key {p0.key} is not the key of certificate"),
        (p0.cert, b"", rf"TLS certificate {p0.cert}: expected PEM certificates"),
        (p0.ca, b"-----BEGIN CERTIFICATE-----\nAAAA\n", rf"TLS CA certificate {p0.ca}: expected"),
    ]
    for path, content, message in cases:
        path.write_bytes(content)
        try:
            with pytest.raises(ConfigError, match=message):
                PartyServer(spec, "P0")
            with pytest.raises(ConfigError, match=message):
                Driver(spec, tls=p0)
        finally:
            path.write_bytes(original[path])
    PartyServer(spec, "P0")  # all good again
