"""A value over 2 GiB moves driver -> party -> party -> driver intact, in chunks, with each
party's peak memory near one copy of it. Slow (about half a minute) and memory hungry."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import mpplug as mp
from mpplug.core.memory import fresh_bytes
from mpplug.remote.driver import Driver
from mpplug.remote.streaming import CHUNK_BYTES

from .clusters import start_parties

NBYTES = 2**31 + CHUNK_BYTES + 3  # past 2 GiB, and not a whole number of chunks
CHECK_ROWS = 64


def _rss_kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None, f"no {field} in /proc/{pid}/status"
    return int(match.group(1))


@mp.function
def hand_over(x: mp.MPObject) -> mp.MPObject:
    return mp.p2p(0, 1, x)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads peak RSS from /proc")
def test_a_value_over_2_gib_moves_between_parties_intact(tmp_path):
    block = np.random.default_rng(0).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
    parties = start_parties(tmp_path / "cluster", 2)
    with parties, Driver(parties.config, timeout=60.0) as driver:
        pids = [parties.processes[name].pid for name in ("P0", "P1")]
        baseline = [_rss_kib(pid, "VmRSS") for pid in pids]
        value = fresh_bytes(NBYTES)  # not np.resize: NumPy's huge pages, on a VM, fault slowly
        rows = NBYTES // CHUNK_BYTES
        value[: rows * CHUNK_BYTES].reshape(rows, CHUNK_BYTES)[:] = block
        value[rows * CHUNK_BYTES :] = block[: NBYTES % CHUNK_BYTES]
        held = driver.put(0, value)
        del value
        moved = driver.evaluate(hand_over, held)
        peaks = [_rss_kib(pid, "VmHWM") - base for pid, base in zip(pids, baseline, strict=True)]
        back = driver.fetch(moved, party=1)
    for rank, peak in enumerate(peaks):
        assert peak * 1024 < 1.25 * NBYTES, f"party {rank} peaked {peak >> 20} GiB over baseline"
    assert back.shape == (NBYTES,) and back.dtype == np.uint8
    rows = NBYTES // CHUNK_BYTES
    for start in range(0, rows, CHECK_ROWS):
        stop = min(start + CHECK_ROWS, rows)
        got = back[start * CHUNK_BYTES : stop * CHUNK_BYTES].reshape(stop - start, CHUNK_BYTES)
        assert (got == block).all(), f"chunks {start}..{stop} differ"
    np.testing.assert_array_equal(back[rows * CHUNK_BYTES :], block[: NBYTES % CHUNK_BYTES])
