"""The party-local group arithmetic of ECDH private set intersection over Curve25519: keys
hashed to X25519 u-coordinates, and blinding by X25519 scalar multiplication.

Threat model: semi-honest parties (B. A. Huberman, M. Franklin, T. Hogg, "Enhancing privacy
and trust in electronic communities", ACM EC 1999). A key is hashed to 32 bytes used directly
as an X25519 u-coordinate, as SPU's ECDH-PSI does for CURVE_25519: a point on the curve or on
its twist, both safe since Curve25519 is twist-secure. A party blinds points with its secret
scalar a as x25519(a, P) (RFC 7748); the clamped scalars are integers, so blinding commutes:
x25519(a, x25519(b, P)) == x25519(b, x25519(a, P)), and both parties' blindings of one key
meet. With the hash modelled as a random oracle, DDH on Curve25519 makes a blinded point
pseudorandom to anyone without the scalar, so a party learns only which keys it shares.

X25519 ignores the top bit of a u-coordinate (RFC 7748, section 5), so a hashed point holds
255 bits of the hash. The scalar products come from Intel's multi-buffer X25519
(`mbx_x25519_mb8` of the Intel Cryptography Primitives Library, `ipp-crypto`, eight points a
call with AVX-512 IFMA, as SPU's ECDH-PSI uses it) where the library loads and the CPU has
IFMA, and from libsodium through PyNaCl otherwise; both run outside the GIL, so large inputs
run on a pool of threads. `MPPLUG_X25519=libsodium` picks libsodium.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import itertools
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from nacl.bindings import crypto_scalarmult

from mpplug.kernels.pools import SharedPool

POINT_BYTES = 32
"""Bytes in a point (an X25519 u-coordinate, little-endian) and in a scalar."""
INLINE_POINTS = 2048
"""Fewer points than this are multiplied on the calling thread."""

_POOL = SharedPool("mpplug-ecdh")


def hash_to_points(keys: Sequence[bytes], domain: bytes) -> np.ndarray:
    """uint8[n, 32]: key i's point, the first 32 bytes of SHA-512(len(domain) || domain ||
    key) with the length as one byte. Parties that intersect use one domain; another domain
    gives unrelated points. Keys are bytes: the caller encodes strings and integers. The
    array is read-only."""
    if len(domain) > 255:
        raise ValueError(f"hash_to_points: domain must be at most 255 bytes, got {len(domain)}")
    prefix = bytes([len(domain)]) + domain
    sha512 = hashlib.sha512
    try:
        digests = [sha512(prefix + key).digest()[:POINT_BYTES] for key in keys]
    except TypeError as e:
        raise TypeError(f"hash_to_points: keys must be bytes (encode them first): {e}") from e
    return np.frombuffer(b"".join(digests), np.uint8).reshape(-1, POINT_BYTES)


def new_scalar() -> np.ndarray:
    """uint8[32]: a fresh secret scalar from the OS's CSPRNG (X25519 clamps it when used)."""
    return np.frombuffer(secrets.token_bytes(POINT_BYTES), np.uint8).copy()


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__


def _multiply_range(scalar: bytes, data: bytes, start: int, stop: int, first: int = 0) -> bytes:
    """libsodium's products of points start..stop-1 of `data`, laid end to end; errors count
    points from `first` (where `data` begins in the caller's input)."""
    products: list[bytes] = []
    append = products.append
    for i in range(start, stop):  # a plain loop, so that a failure names its point
        try:
            append(crypto_scalarmult(scalar, data[POINT_BYTES * i : POINT_BYTES * (i + 1)]))
        except RuntimeError:  # libsodium refuses a low-order point, whose product is zero
            raise ValueError(
                f"x25519: point {first + i} is of low order (the product would be zero); a "
                "peer sent a point no honest party computes"
            ) from None
    return b"".join(products)


_P = 2**255 - 19
LOW_ORDER = np.array(
    [
        [(u >> (64 * w)) & (2**64 - 1) for w in range(4)]
        for u in (
            0,
            1,
            325606250916557431795983626356110631294008115727848805560023387167927233504,
            39382357235489614581723060781553021112529911719440698176882885853963445705823,
            _P - 1,
            _P,
            _P + 1,
        )
    ],
    dtype=np.uint64,
)
"""The u-coordinates (top bit cleared; as four little-endian 64-bit words) whose product by
any clamped scalar is zero: the points of order 1, 2, 4 and 8 on the curve and its twist, as
libsodium lists them."""


def first_low_order(points: np.ndarray) -> int | None:
    """The index of the first low-order point (its top bit ignored, as X25519 ignores it)."""
    words = np.ascontiguousarray(points).view("<u8").copy()  # (n, 4)
    words[:, 3] &= np.uint64(2**63 - 1)
    hit = np.zeros(len(words), bool)
    for row in LOW_ORDER:
        hit |= (words == row).all(axis=1)
    found = np.flatnonzero(hit)
    return int(found[0]) if found.size else None


LANES = 8
"""Points per call of the multi-buffer X25519."""
_RUNTIME_LIBRARIES = ("libintlc.so.5", "libimf.so", "libsvml.so", "libirng.so")
"""What libcrypto_mb.so links against, shipped by intel-cmplr-lib-rt beside it (no rpath)."""


def _library_file(distribution: str, name: str) -> Path | None:
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if f.name == name]
    return Path(str(found[0].locate())) if found else None


@functools.cache
def multi_buffer() -> ctypes.CDLL | None:
    """libcrypto_mb's X25519, loaded once, if installed, working on this CPU (it gives RFC
    7748's product on a test vector) and not turned off by MPPLUG_X25519=libsodium."""
    if os.environ.get("MPPLUG_X25519", "").lower() == "libsodium":
        return None
    try:
        for name in _RUNTIME_LIBRARIES:
            path = _library_file("intel-cmplr-lib-rt", name)
            if path is None:
                return None
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        path = _library_file("ipp-crypto", "libcrypto_mb.so")
        if path is None:
            return None
        library = ctypes.CDLL(str(path))
        library.mbx_x25519_mb8.restype = ctypes.c_uint64
        library.mbx_x25519_mb8.argtypes = [ctypes.c_void_p] * 3
    except (OSError, AttributeError):
        return None
    point = np.frombuffer(bytes([9]) + bytes(31), np.uint8).reshape(1, POINT_BYTES)
    scalar = np.frombuffer(bytes(range(1, 33)), np.uint8)
    expected = crypto_scalarmult(scalar.tobytes(), point.tobytes())
    got = _multi_buffer_products(library, np.repeat(point, LANES, axis=0), scalar)
    return library if got is not None and all(row.tobytes() == expected for row in got) else None


def _multi_buffer_products(
    library: ctypes.CDLL, points: np.ndarray, scalar: np.ndarray
) -> np.ndarray | None:
    """x25519(scalar, p) for points whose count is a multiple of LANES, eight a call; None
    if any call reports a failing lane (a low-order point), for libsodium to name it."""
    points = np.ascontiguousarray(points)
    out = np.empty_like(points)
    n = points.shape[0]
    keys = np.full(LANES, scalar.ctypes.data, np.uint64)
    offsets = POINT_BYTES * np.arange(n, dtype=np.uint64)
    inputs, outputs = points.ctypes.data + offsets, out.ctypes.data + offsets
    call, key = library.mbx_x25519_mb8, keys.ctypes.data
    at_input, at_output = inputs.ctypes.data, outputs.ctypes.data
    for g in range(0, 8 * n, 8 * LANES):  # byte offsets into the address arrays
        if call(at_output + g, key, at_input + g):
            return None
    return out


def _multi_buffer_range(
    library: ctypes.CDLL, scalar: np.ndarray, points: np.ndarray, start: int, stop: int
) -> bytes:
    """The products of points start..stop-1, by eight, the ragged end padded with copies."""
    chunk = points[start:stop]
    short = -len(chunk) % LANES
    padded = np.concatenate([chunk, np.repeat(chunk[:1], short, axis=0)]) if short else chunk
    products = _multi_buffer_products(library, padded, scalar)
    if products is None:  # a lane failed: libsodium names the point
        return _multiply_range(scalar.tobytes(), chunk.tobytes(), 0, len(chunk), start)
    return products[: len(chunk)].tobytes()


def multiply(points: np.ndarray, scalar: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """uint8[n, 32]: x25519(scalar, point) for each of the n points, in order (read-only).

    Inputs of at least INLINE_POINTS points are split into `threads` contiguous chunks
    (default os.cpu_count()), run on a pool of os.cpu_count() threads shared by the process.
    A low-order point raises ValueError naming it: an honest party never sends one.
    """
    if (
        not isinstance(points, np.ndarray)
        or points.dtype != np.uint8
        or points.ndim != 2
        or points.shape[1] != POINT_BYTES
    ):
        raise ValueError(
            f"x25519: points must be a uint8 array of shape (n, {POINT_BYTES}), "
            f"got {_describe(points)}"
        )
    if (
        not isinstance(scalar, np.ndarray)
        or scalar.dtype != np.uint8
        or scalar.shape != (POINT_BYTES,)
    ):
        raise ValueError(
            f"x25519: the scalar must be a uint8 array of shape ({POINT_BYTES},), "
            f"got {_describe(scalar)}"
        )
    if threads is None:
        threads = os.cpu_count() or 1
    if threads < 1:
        raise ValueError(f"x25519: threads must be at least 1, got {threads}")
    n = points.shape[0]
    low = first_low_order(points) if n else None
    if low is not None:  # refused up front: the multi-buffer code returns no zero for them
        raise ValueError(
            f"x25519: point {low} is of low order (the product would be zero); a peer sent a "
            "point no honest party computes"
        )
    library = multi_buffer()
    if library is not None:
        contiguous, key_array = np.ascontiguousarray(points), np.ascontiguousarray(scalar)

        def run(start: int, stop: int) -> bytes:
            return _multi_buffer_range(library, key_array, contiguous, start, stop)

    else:
        data, key = points.tobytes(), scalar.tobytes()

        def run(start: int, stop: int) -> bytes:
            return _multiply_range(key, data, start, stop)

    if n < INLINE_POINTS or threads == 1:
        products = run(0, n)
    else:
        bounds = [n * c // threads for c in range(threads + 1)]
        pool = _POOL.get()
        futures = [pool.submit(run, start, stop) for start, stop in itertools.pairwise(bounds)]
        products = b"".join([f.result() for f in futures])
    return np.frombuffer(products, np.uint8).reshape(n, POINT_BYTES)
