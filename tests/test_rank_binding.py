"""With mutual TLS, a caller is who its certificate names and nothing else: a party cannot send
values as another party or act as the driver, the driver cannot act as a party, and a
certificate from another CA, an expired one or none at all does not get in.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.core import DType, TensorType
from mpplug.core.serde import tensor_type_to_proto
from mpplug.errors import PartyUnavailableError
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.certs import CA_KEY, write_dev_certs
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.rpc import WIRE_VERSION
from mpplug.remote.tls import channel_credentials, driver_tls

from .clusters import POOL

F32 = tensor_type_to_proto(TensorType(DType.FLOAT32, ()))


@pytest.fixture
def parties() -> LocalParties:
    return POOL.get(3, tls=True)


def _channel(parties: LocalParties, rank: int, files: TLSFiles) -> grpc.Channel:
    return grpc.secure_channel(parties.spec.parties[rank].endpoint, channel_credentials(files))


def _send_to_p0(parties: LocalParties, files: TLSFiles, src: int) -> grpc.RpcError | None:
    """Send party 0 a value claiming to come from party `src`, with `files` as our identity."""
    header = pb.PeerHeader(exec_id="s1:e1", op=1, src=src, dst=0, type=F32)
    chunk = pb.PeerChunk(header=header, data=np.float32(1).tobytes())
    with _channel(parties, 0, files) as channel:
        try:
            rpc_pb.PeerServiceStub(channel).SendSmall(chunk, timeout=5.0)
        except grpc.RpcError as exc:
            return exc
    return None


def _health(endpoint: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError | None:
    channel = (
        grpc.insecure_channel(endpoint)
        if credentials is None
        else grpc.secure_channel(endpoint, credentials)
    )
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5.0)
        except grpc.RpcError as exc:
            return exc
    return None


def _assert_refused_at_handshake(
    parties: LocalParties, credentials: grpc.ChannelCredentials | None
):
    error = _health(parties.spec.parties[0].endpoint, credentials)
    assert error is not None, "the client was let in"
    assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()


def _issue(ca_dir: Path, name: str, out: Path, *, expired: bool) -> TLSFiles:
    """A certificate for CN `name` signed by the cluster CA in `ca_dir`, valid now or not."""
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start, end = (now - datetime.timedelta(days=30), now - datetime.timedelta(days=1))
    if not expired:
        start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return TLSFiles(ca_dir / "ca.pem", out / f"{name}.pem", out / f"{name}.key")


def test_a_party_certificate_cannot_send_values_as_another_party(parties):
    p1 = parties.spec.parties[1].tls
    error = _send_to_p0(parties, p1, src=2)
    assert error is not None and error.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "claims to come from 'P2', but the caller's certificate names 'P1'" in error.details()
    assert _send_to_p0(parties, p1, src=1) is None  # as itself it is let in
    itself = _send_to_p0(parties, parties.spec.parties[0].tls, src=1)
    assert itself is not None and itself.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "but the caller's certificate names 'P0'" in itself.details()


def test_a_party_certificate_cannot_act_as_the_driver(parties):
    p1 = parties.spec.parties[1].tls
    with _channel(parties, 0, p1) as channel:
        stub = rpc_pb.PartyServiceStub(channel)
        for call, request in [
            (
                stub.OpenSession,
                pb.OpenSessionRequest(
                    session="s1", parties=["P0", "P1", "P2"], wire_version=WIRE_VERSION
                ),
            ),
            (stub.Execute, pb.ExecuteRequest(session="s1", exec_id="e1", digest="d" * 64)),
            (stub.Release, pb.ReleaseRequest(session="s1", names=["x"])),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=5.0)
            assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
            method = call._method.decode().rsplit("/", 1)[1]  # type: ignore[attr-defined]
            assert (
                f"party P0 takes {method} only from a driver, but the caller's certificate "
                f"names party 'P1'"
            ) in info.value.details()
        assert stub.Status(pb.StatusRequest(), timeout=5.0).party == "P0"  # read-only: allowed
    with pytest.raises(Exception, match="only from a driver") as driving:
        Driver(parties.config, timeout=5.0, tls=p1)
    assert "P1" in str(driving.value)


def test_the_driver_certificate_cannot_act_as_a_party(parties):
    error = _send_to_p0(parties, driver_tls(parties.spec, None), src=1)
    assert error is not None and error.code() is grpc.StatusCode.PERMISSION_DENIED
    assert (
        "party 0 accepts values only from the other parties ['P1', 'P2'], but the caller's "
        "certificate names 'driver'"
    ) in error.details()


def test_a_certificate_from_another_ca_is_refused(parties, tmp_path):
    ours = parties.spec.parties[1].tls
    other = write_dev_certs(ClusterSpec.local(3), tmp_path / "other")
    _assert_refused_at_handshake(
        parties, channel_credentials(TLSFiles(ours.ca, other["P1"].cert, other["P1"].key))
    )
    with pytest.raises(PartyUnavailableError):
        Driver(parties.config, timeout=5.0, tls=other["driver"])


def test_an_expired_certificate_from_the_cluster_ca_is_refused(parties, tmp_path):
    ca_dir = parties.spec.parties[0].tls.ca.parent
    expired = _issue(ca_dir, "driver", tmp_path, expired=True)
    _assert_refused_at_handshake(parties, channel_credentials(expired))
    with pytest.raises(PartyUnavailableError):
        Driver(parties.config, timeout=5.0, tls=expired)
    # The same name, signed by the same CA and still valid, gets in.
    assert (
        _health(
            parties.spec.parties[0].endpoint,
            channel_credentials(_issue(ca_dir, "driver", tmp_path / "valid", expired=False)),
        )
        is None
    )


def test_a_client_without_a_certificate_is_refused(parties):
    ca = parties.spec.parties[0].tls.ca
    _assert_refused_at_handshake(parties, grpc.ssl_channel_credentials(ca.read_bytes()))


def test_a_plaintext_client_is_refused(parties):
    _assert_refused_at_handshake(parties, None)
