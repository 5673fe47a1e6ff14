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
255 bits of the hash. The scalar products come from libsodium through PyNaCl, which releases
the GIL, so large inputs run on a pool of threads.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from nacl.bindings import crypto_scalarmult

POINT_BYTES = 32
"""Bytes in a point (an X25519 u-coordinate, little-endian) and in a scalar."""
INLINE_POINTS = 2048
"""Fewer points than this are multiplied on the calling thread."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of its parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="mpplug-ecdh")
        return _pool


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


def _multiply_range(scalar: bytes, data: bytes, start: int, stop: int) -> bytes:
    """The products of points start..stop-1 of `data`, laid end to end."""
    products: list[bytes] = []
    append = products.append
    for i in range(start, stop):  # a plain loop, so that a failure names its point
        try:
            append(crypto_scalarmult(scalar, data[POINT_BYTES * i : POINT_BYTES * (i + 1)]))
        except RuntimeError:  # libsodium refuses a low-order point, whose product is zero
            raise ValueError(
                f"x25519: point {i} is of low order (the product would be zero); a peer sent "
                "a point no honest party computes"
            ) from None
    return b"".join(products)


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
    data, key = points.tobytes(), scalar.tobytes()
    if n < INLINE_POINTS or threads == 1:
        products = _multiply_range(key, data, 0, n)
    else:
        bounds = [n * c // threads for c in range(threads + 1)]
        pool = _executor()
        futures = [
            pool.submit(_multiply_range, key, data, start, stop)
            for start, stop in itertools.pairwise(bounds)
        ]
        products = b"".join([f.result() for f in futures])
    return np.frombuffer(products, np.uint8).reshape(n, POINT_BYTES)
