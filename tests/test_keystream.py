"""The `mpplug.keystream` kernel: RFC 8439 ChaCha20 blocks (checked against an independent
implementation, itself checked on the RFC's quarter-round vector), each role drawing only the
streams its row chose, and clear refusals of malformed records."""

from __future__ import annotations

import gc
import struct
import time
from typing import Any

import numpy as np
import pytest

from mpplug import InvalidPFunctionError, PFunction
from mpplug.kernels import KernelRuntime, invoke, keystream
from mpplug.kernels.keystream import NONCE_TAG, keystream_blocks, keystream_pfunction

MASK = 0xFFFFFFFF


def quarter(s: list[int], a: int, b: int, c: int, d: int) -> None:
    def rotl(x: int, n: int) -> int:
        return ((x << n) | (x >> (32 - n))) & MASK

    s[a] = (s[a] + s[b]) & MASK
    s[d] = rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & MASK
    s[b] = rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & MASK
    s[d] = rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & MASK
    s[b] = rotl(s[b] ^ s[c], 7)


def reference_block(key: bytes, counter: int, nonce: tuple[int, int, int]) -> list[int]:
    """RFC 8439 section 2.3, written out."""
    state = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574]
    state += [*struct.unpack("<8I", key), counter, *nonce]
    s = list(state)
    for _ in range(10):
        for q in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)):
            quarter(s, *q)
        for q in ((0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            quarter(s, *q)
    return [(x + y) & MASK for x, y in zip(s, state, strict=True)]


def test_the_reference_quarter_round_matches_rfc_8439():
    s = [0x11111111, 0x01020304, 0x9B8D6F43, 0x01234567]
    quarter(s, 0, 1, 2, 3)
    assert s == [0xEA2A92F4, 0xCB1CF8CE, 0x4581472E, 0x5881C4BB]  # RFC 8439 section 2.1.1


@pytest.mark.parametrize("stream", [0, 1, 2**32 + 7])
def test_blocks_are_chacha20_with_the_stream_in_the_nonce(stream: int):
    key = bytes(range(32))
    got = keystream_blocks(key, stream, 3)
    nonce = (stream & MASK, stream >> 32, NONCE_TAG)
    for counter in range(3):
        assert got[counter].tolist() == reference_block(key, counter, nonce)


def run(pfunc: PFunction, *args: np.ndarray) -> np.ndarray:
    """The kernel's uint64 words, as the uint32[blocks, 16] they pack (low word first)."""
    words = np.asarray(invoke(pfunc, *args, runtime=KernelRuntime())[0])
    assert words.dtype == np.uint64 and words.ndim == 1
    low, high = words & MASK, words >> np.uint64(32)
    return np.stack([low, high], axis=1).astype(np.uint32).reshape(-1, 16)


def test_each_role_draws_only_the_streams_its_row_chose():
    keys = np.random.default_rng(3).integers(0, 2**32, (3, 8), dtype=np.uint32)
    counts = [2, 1, 3]
    rows = [[1, 1, 0], [0, 1, 1], [1, 0, 0]]
    draw = keystream_pfunction([10, 11, 12], counts, rows)
    assert draw.outs_info[0].shape == (4 * 8,)  # the widest row: 1 + 3 blocks of 8 words
    blocks = {
        s: keystream_blocks(keys[i].astype("<u4").tobytes(), s, c)
        for i, (s, c) in enumerate(zip([10, 11, 12], counts, strict=True))
    }
    role0 = run(draw, keys, np.int32(0))
    np.testing.assert_array_equal(role0[:3], np.concatenate([blocks[10], blocks[11]]))
    assert not role0[3:].any()
    role1 = run(draw, keys, np.int32(1))
    np.testing.assert_array_equal(role1, np.concatenate([blocks[11], blocks[12]]))
    beyond = run(draw, keys, np.int32(7))  # past the last row: the last row
    np.testing.assert_array_equal(beyond[:2], blocks[10])
    assert not beyond[2:].any()


def test_slack_is_zeros_after_the_widest_row():
    keys = np.random.default_rng(4).integers(0, 2**32, (2, 8), dtype=np.uint32)
    draw = keystream_pfunction([20, 21], [2, 1], [[1, 0], [0, 1]], slack=3)
    assert draw.attrs["slack"] == 3
    assert draw.outs_info[0].shape == ((2 + 3) * 8,)  # the widest row, then 3 blocks of zeros
    role0 = run(draw, keys, np.int32(0))
    np.testing.assert_array_equal(
        role0[:2], keystream_blocks(keys[0].astype("<u4").tobytes(), 20, 2)
    )
    assert not role0[2:].any()
    role1 = run(draw, keys, np.int32(1))
    np.testing.assert_array_equal(
        role1[:1], keystream_blocks(keys[1].astype("<u4").tobytes(), 21, 1)
    )
    assert not role1[1:].any()
    assert "slack" not in keystream_pfunction([20], [1], [[1]]).attrs


def test_malformed_records_are_refused_with_what_is_wrong():
    good = keystream_pfunction([1, 2], [1, 1], [[1, 1]])
    keys = np.zeros((2, 8), np.uint32)
    cases = {
        "rows": ({"rows": bytes([1, 2])}, "one 0 or 1 per stream"),
        "ragged rows": ({"rows": bytes([1, 1, 1])}, "one 0 or 1 per stream"),
        "counts": ({"counts": np.asarray([1], "<u4").tobytes()}, "one entry per stream"),
        "zero count": ({"counts": np.asarray([1, 0], "<u4").tobytes()}, "counts >= 1"),
        "streams": ({"streams": (1, 2)}, "packed <u8 values"),
        "odd bytes": ({"streams": bytes(9)}, "multiple of 8"),
        "huge": ({"counts": np.asarray([2**30, 1], "<u4").tobytes()}, None),
        "slack": ({"slack": -1}, "'slack' to be an int"),
        "slack type": ({"slack": b"1"}, "'slack' to be an int"),
        "slack types": ({"slack": 1}, "expected"),  # the output no longer has its width
    }
    for name, (attrs, message) in cases.items():
        bad = PFunction(
            good.fn_type, good.fn_name, b"", good.ins_info, good.outs_info, {**good.attrs, **attrs}
        )
        with pytest.raises(InvalidPFunctionError) as info:
            run(bad, keys)
        assert "mpplug.keystream" in str(info.value), name
        if message is not None:
            assert message in str(info.value), name


def test_iteration_t_of_a_loop_draws_its_streams_moved_on_by_t_strides():
    keys = np.random.default_rng(5).integers(0, 2**32, (2, 8), dtype=np.uint32)
    draw = keystream_pfunction([40, 41], [1, 2], [[1, 1]], stride=2)
    assert draw.attrs["stride"] == 2 and len(draw.ins_info) == 2
    for t in (0, 3):
        want = [
            keystream_blocks(keys[i].astype("<u4").tobytes(), 40 + i + 2 * t, c)
            for i, c in enumerate((1, 2))
        ]
        np.testing.assert_array_equal(run(draw, keys, np.int32(t)), np.concatenate(want))
    with pytest.raises(InvalidPFunctionError, match="iteration >= 0"):
        run(draw, keys, np.int32(-1))
    bad = PFunction(
        draw.fn_type, draw.fn_name, b"", draw.ins_info, draw.outs_info, {**draw.attrs, "stride": 0}
    )
    with pytest.raises(InvalidPFunctionError, match="'stride'"):
        run(bad, keys, np.int32(0))
    unstepped = keystream_pfunction([40, 41], [1, 2], [[1, 1]])
    stepped_types = PFunction(
        unstepped.fn_type,
        unstepped.fn_name,
        b"",
        unstepped.ins_info,
        unstepped.outs_info,
        {**unstepped.attrs, "stride": 2},
    )
    with pytest.raises(InvalidPFunctionError, match="expected"):
        run(stepped_types, keys)


def test_a_runtime_draws_again_into_the_buffer_no_array_holds_any_more():
    """Fresh memory is slow to write first (page by page): a party's next draw of the same size
    reuses its last buffer once nothing made from it is alive (JAX lets go of it at the next
    garbage collection), clearing what the row leaves unwritten, and never while an array
    from it is alive. Streams past a MiB come out whole."""
    keys = np.random.default_rng(7).integers(0, 2**32, (2, 8), dtype=np.uint32)
    counts = [20_000, 3]  # 1.28 MB: drawn a MiB at a time
    draw = keystream_pfunction([50, 51], counts, [[1, 1], [0, 1]])
    runtime = KernelRuntime()
    blocks = [
        keystream_blocks(keys[i].astype("<u4").tobytes(), 50 + i, c) for i, c in enumerate(counts)
    ]

    def words(role: int) -> tuple[Any, int]:
        (out,) = invoke(draw, keys, np.int32(role), runtime=runtime)
        return out, out.unsafe_buffer_pointer()

    first, where = words(0)
    held = np.asarray(first).copy()
    np.testing.assert_array_equal(held.view("<u4").reshape(-1, 16), np.concatenate(blocks))
    second, elsewhere = words(1)  # `first` is alive: a buffer of its own
    assert elsewhere != where
    np.testing.assert_array_equal(np.asarray(first), held)
    del first, second
    reused = None
    for _ in range(20):  # JAX lets go of what it took from numpy at the next collection
        full, where = words(0)
        del full
        gc.collect(0)
        short, again = words(1)
        if again == where:
            reused = short
            break
        del short
        time.sleep(0.05)
    assert reused is not None, "no draw reused the buffer of the draw before it"
    got = np.asarray(reused).view("<u4").reshape(-1, 16)
    np.testing.assert_array_equal(got[:3], blocks[1])
    assert not got[3:].any()


def test_a_party_keeps_no_more_than_its_bound_of_buffers(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(keystream, "KEPT_BYTES", 1 << 20)
    runtime = KernelRuntime()
    keys = np.zeros((1, 8), np.uint32)
    for count in (100, 20_000, 200, 20_000):  # 6.4 kB, 1.28 MB (over the bound), 12.8 kB
        invoke(keystream_pfunction([1], [count], [[1]]), keys, runtime=runtime)
    kept = runtime.cache(keystream.KEYSTREAM)
    assert len(kept) == 2 and kept.weight < 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_what_a_role_leaves_undrawn_is_zeros_that_never_take_memory():
    """The buffer is as wide as the widest role's draw; a role drawing less gets zeros past
    its streams without writing them (fresh pages cost about a millisecond a MiB to write
    on a virtual machine), so its resident memory grows by what it drew, not by the width."""
    keys = np.random.default_rng(3).integers(0, 2**32, (2, 8), dtype=np.uint32)
    counts = [2_000_000, 1]  # 128 MB for role 0; one block for role 1
    draw = keystream_pfunction([60, 61], counts, [[1, 1], [0, 1]])
    before = resident_bytes()
    (out,) = invoke(draw, keys, np.int32(1), runtime=KernelRuntime())
    grown = resident_bytes() - before
    assert grown < 32 << 20, f"drawing one block took {grown >> 20} MiB"
    words = np.asarray(out)
    assert words.nbytes == 64 * (counts[0] + counts[1])
    np.testing.assert_array_equal(
        words[:8].view("<u4").reshape(1, 16), keystream_blocks(keys[1].tobytes(), 61, 1)
    )
    assert not words[8:].any()
