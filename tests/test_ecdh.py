"""ECDH-PSI group arithmetic: X25519 against RFC 7748's vectors, commutative blinding on the
threaded path, hashing to points, and the errors for bad inputs and low-order points; on
each backend (Intel's multi-buffer X25519 where it loads, libsodium always)."""

from __future__ import annotations

import numpy as np
import pytest
from nacl.bindings import crypto_scalarmult

from mpplug.tables import ecdh
from mpplug.tables.ecdh import INLINE_POINTS, hash_to_points, multiply, new_scalar

BACKENDS = ["multi-buffer", "libsodium"]


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on each backend; the multi-buffer one is skipped where it does not load."""
    if request.param == "libsodium":
        monkeypatch.setattr(ecdh, "multi_buffer", lambda: None)
    elif ecdh.multi_buffer() is None:
        pytest.skip("Intel's multi-buffer X25519 does not load here (no ipp-crypto, or no IFMA)")
    return str(request.param)


def u8(hex_string: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hex_string), np.uint8)


def x25519(scalar: np.ndarray, point: np.ndarray) -> np.ndarray:
    """One point through `multiply`, as RFC 7748's X25519(k, u)."""
    return multiply(point.reshape(1, 32), scalar)[0]


@pytest.mark.parametrize(
    ("scalar", "u", "product"),
    [
        (
            "a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
            "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c",
            "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552",
        ),
        (  # the u-coordinate's top bit is set, and X25519 ignores it
            "4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",
            "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493",
            "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957",
        ),
    ],
)
def test_rfc7748_vectors(scalar: str, u: str, product: str) -> None:
    assert x25519(u8(scalar), u8(u)).tobytes().hex() == product


def test_rfc7748_iterated() -> None:
    k = u = u8("09" + "00" * 31)
    for i in range(1, 1001):
        k, u = x25519(k, u), k
        if i == 1:
            assert k.tobytes().hex() == (
                "422c8e7a6227d7bca1350b3e2bb7279f7897b87bb6854b783c60e80311ae3079"
            )
    assert k.tobytes().hex() == "684cf59ba83309552800ef566f2f4d3c1c3887c49360e3875f2eb94d99532c51"


def test_rfc7748_diffie_hellman() -> None:
    base = u8("09" + "00" * 31)
    alice = u8("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    bob = u8("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
    shared = "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"
    assert x25519(alice, x25519(bob, base)).tobytes().hex() == shared
    assert x25519(bob, x25519(alice, base)).tobytes().hex() == shared


def test_blinding_commutes_on_the_threaded_path() -> None:
    n = 5003  # the multi-buffer backend's ragged end too
    assert n >= 2 * INLINE_POINTS
    points = hash_to_points([i.to_bytes(8, "little") for i in range(n)], b"test")
    a, b = new_scalar(), new_scalar()
    assert a.tobytes() != b.tobytes()
    blinded_a = multiply(points, a, threads=2)
    reference = b"".join(crypto_scalarmult(a.tobytes(), p.tobytes()) for p in points)
    assert blinded_a.shape == (n, 32) and blinded_a.dtype == np.uint8
    assert blinded_a.tobytes() == reference
    assert multiply(points, a, threads=3).tobytes() == reference  # uneven chunks
    assert multiply(points, a, threads=1).tobytes() == reference  # inline
    ab = multiply(blinded_a, b, threads=2)
    ba = multiply(multiply(points, b, threads=2), a, threads=2)
    np.testing.assert_array_equal(ab, ba)
    assert len({row.tobytes() for row in ab}) == n


def test_empty_input() -> None:
    out = multiply(np.zeros((0, 32), np.uint8), new_scalar())
    assert out.shape == (0, 32) and out.dtype == np.uint8
    assert hash_to_points([], b"d").shape == (0, 32)


def test_hash_to_points() -> None:
    keys = [b"alice", b"bob", b"", b"carol" * 100]
    points = hash_to_points(keys, b"psi")
    assert points.shape == (4, 32) and points.dtype == np.uint8
    np.testing.assert_array_equal(points, hash_to_points(keys, b"psi"))
    assert len({row.tobytes() for row in points}) == 4
    other = hash_to_points(keys, b"psi2")
    assert not any(p.tobytes() == q.tobytes() for p, q in zip(points, other, strict=True))
    # The domain's length is hashed too, so (domain, key) pairs never run together.
    assert hash_to_points([b"bc"], b"a")[0].tobytes() != hash_to_points([b"c"], b"ab")[0].tobytes()


def test_hash_to_points_errors() -> None:
    with pytest.raises(ValueError, match=r"domain must be at most 255 bytes, got 256"):
        hash_to_points([b"k"], b"d" * 256)
    with pytest.raises(TypeError, match=r"keys must be bytes"):
        hash_to_points(["alice"], b"d")  # type: ignore[list-item]


def test_new_scalar() -> None:
    scalar = new_scalar()
    assert scalar.shape == (32,) and scalar.dtype == np.uint8
    assert scalar.tobytes() != new_scalar().tobytes()


@pytest.mark.parametrize(
    ("points", "got"),
    [
        (np.zeros((4, 31), np.uint8), r"uint8 array of shape \(4, 31\)"),
        (np.zeros((4, 32), np.int32), r"int32 array of shape \(4, 32\)"),
        (np.zeros(32, np.uint8), r"uint8 array of shape \(32,\)"),
        ([[0] * 32], r"list"),
    ],
)
def test_bad_points(points: object, got: str) -> None:
    with pytest.raises(
        ValueError, match=r"points must be a uint8 array of shape \(n, 32\), got " + got
    ):
        multiply(points, new_scalar())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("scalar", "got"),
    [
        (np.zeros(31, np.uint8), r"uint8 array of shape \(31,\)"),
        (np.zeros((1, 32), np.uint8), r"uint8 array of shape \(1, 32\)"),
        (np.zeros(32, np.int8), r"int8 array of shape \(32,\)"),
        (bytes(32), r"bytes"),
    ],
)
def test_bad_scalar(scalar: object, got: str) -> None:
    points = hash_to_points([b"k"], b"d")
    with pytest.raises(
        ValueError, match=r"scalar must be a uint8 array of shape \(32,\), got " + got
    ):
        multiply(points, scalar)  # type: ignore[arg-type]


def test_bad_threads() -> None:
    with pytest.raises(ValueError, match=r"threads must be at least 1, got 0"):
        multiply(hash_to_points([b"k"], b"d"), new_scalar(), threads=0)


def test_the_low_order_list_is_libsodiums() -> None:
    scalar = new_scalar().tobytes()
    for words in ecdh.LOW_ORDER:
        point = words.astype("<u8").tobytes()
        with pytest.raises(RuntimeError):
            crypto_scalarmult(scalar, point)
        top_bit_set = point[:31] + bytes([point[31] | 0x80])
        with pytest.raises(RuntimeError):
            crypto_scalarmult(scalar, top_bit_set)


@pytest.mark.parametrize(
    "low_order",
    [*(w.astype("<u8").tobytes() for w in ecdh.LOW_ORDER), (2**255 + 1).to_bytes(32, "little")],
    ids=["zero", "one", "order-8-a", "order-8-b", "minus-one", "p", "p-plus-one", "top-bit-one"],
)
@pytest.mark.parametrize("index", [0, 3001])
def test_low_order_point(low_order: bytes, index: int) -> None:
    points = hash_to_points([i.to_bytes(4, "little") for i in range(5000)], b"d").copy()
    points[index] = np.frombuffer(low_order, np.uint8)
    with pytest.raises(ValueError, match=rf"point {index} is of low order"):
        multiply(points, new_scalar(), threads=2)
