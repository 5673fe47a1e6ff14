"""The persistent compile cache: a second process reuses what the first compiled and traced,
and a damaged, foreign or outdated entry is never loaded, only rebuilt; the folder stays
within its bound even when processes fill it at once. Also the in-memory executable caches'
weight bound and the progress lines a long compile logs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug.core import progress
from mpplug.kernels import KernelRuntime, invoke, jax_exec
from mpplug.kernels.compile_cache import SUFFIX, DiskCache, cache_key, disk_cache
from mpplug.kernels.runtime import DEFAULT_CACHE_SIZE, LRUCache
from mpplug.mpc import emit, ring, trace_cache

REPO = Path(__file__).resolve().parent.parent
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)


def f(x, y):
    return jnp.tanh(x @ y) + 1


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder named by MPPLUG_CACHE_DIR, and fresh in-memory caches."""
    path = tmp_path / "cache"
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(path))
    monkeypatch.setattr(
        jax_exec,
        "_PROCESS_CACHE",
        LRUCache(DEFAULT_CACHE_SIZE, weigh=jax_exec._weight, max_weight=1 << 30),
    )
    return path


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{SUFFIX}"))


def new_entry(folder: Path, pfunc: mp.PFunction) -> Path:
    """The one entry a first call of `pfunc` adds to the folder: its executable."""
    before = set(entries(folder))
    fresh_call(pfunc)
    (entry,) = set(entries(folder)) - before
    return entry


def fresh_call(pfunc: mp.PFunction) -> Any:
    """Run `pfunc` on a fresh runtime with a fresh process cache (as a new process would)."""
    jax_exec._PROCESS_CACHE = LRUCache(
        DEFAULT_CACHE_SIZE, weigh=jax_exec._weight, max_weight=1 << 30
    )
    return invoke(pfunc, X, X, runtime=KernelRuntime())


# ---------------------------------------------------------------- across processes

SECURE_PROGRAM = textwrap.dedent(
    """
    import json
    import numpy as np
    import mpplug as mp
    from mpplug.kernels import jax_exec
    from mpplug.kernels.compile_cache import disk_cache
    from mpplug.mpc import emit

    @mp.function
    def prog(x):
        return mp.mpc.reveal(mp.mpc.run(lambda a: a * a + 1.0, mp.mpc.seal(x)), to=0)

    with mp.Simulator(3) as sim:
        x = sim.put(0, np.arange(4.0))
        got = sim.fetch(sim.evaluate(prog, x), party=0)
        sim.fetch(sim.evaluate(prog, x), party=0)  # the second run compiles (and stores)
    stats = disk_cache().stats
    print(json.dumps({"got": got.tolist(), "hits": stats.hits, "writes": stats.writes,
                      "misses": stats.misses, "refused": stats.refused,
                      "written": len(emit._WRITTEN),
                      "lapack": jax_exec._lapack_ready.cache_info().currsize}))
    """
)


def run_secure_program(folder: Path) -> dict[str, Any]:
    env = {**os.environ, "MPPLUG_CACHE_DIR": str(folder), "PYTHONPATH": str(REPO)}
    env["MPPLUG_TIER_UP"] = "wait"  # the second run's compiles all end before the process does
    done = subprocess.run(
        [sys.executable, "-c", SECURE_PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_a_second_process_reuses_the_first_ones_executables_and_traces(tmp_path: Path):
    folder = tmp_path / "cache"
    first = run_secure_program(folder)
    second = run_secure_program(folder)
    np.testing.assert_allclose(first["got"], np.arange(4.0) ** 2 + 1, atol=1e-3)
    assert second["got"] == first["got"]
    assert first["hits"] == 0 and first["writes"] > 0
    # everything the first wrote is found: each executable, and the traced share program
    assert second["writes"] == 0 and second["misses"] == 0
    assert second["hits"] == first["writes"] == len(entries(folder))
    # nothing is written again: neither the rounds nor the seal's and reveal's own functions
    assert second["written"] == 0 < first["written"]
    assert second["lapack"] == 0  # no custom calls: LAPACK (scipy.linalg, 70 ms) not loaded


def test_a_seal_and_a_reveal_are_traced_once_per_type_and_encoding(
    folder: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(trace_cache, "_FUNCTIONS", LRUCache(DEFAULT_CACHE_SIZE))
    traced: list[str] = []
    write = emit.jaxpr_function
    monkeypatch.setattr(
        emit, "jaxpr_function", lambda name, *a: traced.append(name) or write(name, *a)
    )

    def square_plus_one(frac_bits: int) -> Any:
        def prog(x):
            sealed = mp.mpc.seal(x, frac_bits=frac_bits)
            return mp.mpc.reveal(mp.mpc.run(lambda a: a * a + 1.0, sealed), to=0)

        return mp.function(prog)

    x = np.linspace(-2, 2, 12).reshape(3, 4)
    with mp.Simulator(3) as sim:
        for frac_bits, new in ((18, {"context", "split", "first_share", "combine"}), (18, set())):
            got = sim.fetch(sim.evaluate(square_plus_one(frac_bits), sim.put(0, x)), party=0)
            np.testing.assert_allclose(got, x * x + 1, atol=1e-3)
            assert set(traced) == new, frac_bits
            traced.clear()
        got = sim.fetch(sim.evaluate(square_plus_one(12), sim.put(0, x)), party=0)
        np.testing.assert_allclose(got, x * x + 1, atol=3e-2)
        assert sorted(traced) == ["combine", "split"]  # another encoding and decoding
        traced.clear()
        got = sim.fetch(sim.evaluate(square_plus_one(12), sim.put(0, x[:2])), party=0)
        assert sorted(traced) == ["combine", "first_share", "split"]  # another shape
    np.testing.assert_allclose(got, x[:2] ** 2 + 1, atol=3e-2)


def test_with_the_cache_off_a_seal_is_traced_from_the_code_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
):
    """A test that changes protocol code (a mutation check) turns the cache off: nothing kept
    by recipe then hides its change, in memory either."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")
    monkeypatch.setattr(trace_cache, "_FUNCTIONS", LRUCache(DEFAULT_CACHE_SIZE))
    x = np.linspace(-2, 2, 6)
    prog = mp.function(lambda v: mp.mpc.reveal(mp.mpc.seal(v), to=0))
    with mp.Simulator(3) as sim:
        np.testing.assert_allclose(sim.fetch(sim.evaluate(prog, sim.put(0, x)), 0), x, atol=1e-5)
        monkeypatch.setattr(
            ring.Decoding, "__call__", lambda self, v: ring.decode(v, 17, self.dtype)
        )
        again = mp.function(lambda v: mp.mpc.reveal(mp.mpc.seal(v), to=0))
        np.testing.assert_allclose(
            sim.fetch(sim.evaluate(again, sim.put(0, x)), 0), 2 * x, atol=1e-5
        )
    assert len(trace_cache._FUNCTIONS) == 0


def test_a_protocols_local_function_is_read_back_and_a_bad_entry_is_rebuilt(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    pfunc = mp.jax_export(f, X, X)[0]
    made: list[mp.PFunction] = []

    def make() -> tuple[mp.PFunction, bool]:
        made.append(pfunc)
        return pfunc, True

    def kept() -> Any:  # as a new process would find it: nothing in memory
        monkeypatch.setattr(trace_cache, "_FUNCTIONS", LRUCache(DEFAULT_CACHE_SIZE))
        return trace_cache.local_function(("test", "square"), pfunc.ins_info, None, make)

    before = set(entries(folder))
    assert kept() == (pfunc, True) and len(made) == 1
    assert kept() == (pfunc, True) and len(made) == 1  # read back from the folder
    (entry,) = set(entries(folder)) - before
    disk_cache().put(bytes.fromhex(entry.name[: -len(SUFFIX)]), b"1not a function")
    with caplog.at_level(logging.WARNING, logger="mpplug"):
        assert kept() == (pfunc, True) and len(made) == 2  # whole but not one: made again
    assert "ignoring a local function" in caplog.text
    assert kept() == (pfunc, True) and len(made) == 2  # and stored again, whole


LAPACK_PROGRAM = textwrap.dedent(
    """
    import json
    import jax.numpy as jnp
    import numpy as np
    import mpplug as mp
    from mpplug.kernels import jax_exec
    from mpplug.kernels.compile_cache import disk_cache

    spd = np.array([[4.0, 1.0], [1.0, 3.0]], np.float32)
    prog = mp.function(lambda x: mp.run_jax(lambda m: jnp.linalg.cholesky(jnp.linalg.inv(m)), x))
    with mp.Simulator(1) as sim:
        got = sim.fetch(sim.evaluate(prog, sim.put(0, spd)), party=0)
    lapack = jax_exec._lapack_ready.cache_info().currsize
    print(json.dumps({"got": got.tolist(), "hits": disk_cache().stats.hits, "lapack": lapack}))
    """
)


def test_a_cached_executable_that_calls_lapack_runs_in_a_new_process(tmp_path: Path):
    env = {**os.environ, "MPPLUG_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    runs = []
    for _ in range(2):  # the second loads the executable: LAPACK must be loaded for it
        done = subprocess.run(
            [sys.executable, "-c", LAPACK_PROGRAM], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    want = np.linalg.cholesky(np.linalg.inv([[4.0, 1.0], [1.0, 3.0]]))
    np.testing.assert_allclose(runs[1]["got"], want, rtol=1e-5)
    assert runs[1]["got"] == runs[0]["got"] and runs[1]["hits"] > runs[0]["hits"] == 0
    assert runs[1]["lapack"] == 1  # loaded before the executable that calls it


# ---------------------------------------------------------------- entries never loaded


def test_a_truncated_entry_is_ignored_and_rebuilt(folder: Path):
    pfunc = mp.jax_export(f, X, X)[0]
    expected = np.tanh(X @ X) + 1
    entry = new_entry(folder, pfunc)
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    np.testing.assert_allclose(fresh_call(pfunc)[0], expected, rtol=1e-6)
    stats = disk_cache().stats
    assert stats.refused == 1 and stats.writes == 3  # the export, the executable twice
    assert len(entry.read_bytes()) > len(whole) // 2  # rebuilt in place, whole
    fresh_call(pfunc)
    assert disk_cache().stats.hits == 1


def test_a_corrupted_entry_is_ignored_and_rebuilt(folder: Path):
    pfunc = mp.jax_export(f, X, X)[0]
    entry = new_entry(folder, pfunc)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the executable
    entry.write_bytes(bytes(data))
    np.testing.assert_allclose(fresh_call(pfunc)[0], np.tanh(X @ X) + 1, rtol=1e-6)
    assert disk_cache().stats.refused == 1


def test_a_foreign_entry_under_another_key_is_never_loaded(folder: Path):
    g = mp.jax_export(lambda x, y: x - y, X, X)[0]
    pfunc = mp.jax_export(f, X, X)[0]
    theirs = new_entry(folder, g)
    mine = new_entry(folder, pfunc)
    mine.write_bytes(theirs.read_bytes())  # g's executable filed under f's key
    np.testing.assert_allclose(fresh_call(pfunc)[0], np.tanh(X @ X) + 1, rtol=1e-6)
    assert disk_cache().stats.refused == 1


def test_another_jaxlib_version_misses(folder: Path, monkeypatch: pytest.MonkeyPatch):
    pfunc = mp.jax_export(f, X, X)[0]
    new_entry(folder, pfunc)
    monkeypatch.setattr(jax_exec, "jaxlib_version", lambda: "0.0.1-another")
    new_entry(folder, pfunc)  # a second executable entry, under the other version's key
    stats = disk_cache().stats
    assert stats.hits == 0


@pytest.mark.parametrize("value", ["", "  ", "0", "off", "OFF", "false", "No", "none"])
def test_an_empty_or_off_cache_dir_turns_the_cache_off(
    value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.chdir(tmp_path)  # where a relative folder named by the value would go
    monkeypatch.setenv("MPPLUG_CACHE_DIR", value)
    assert disk_cache() is None
    np.testing.assert_allclose(
        fresh_call(mp.jax_export(f, X, X)[0])[0], np.tanh(X @ X) + 1, rtol=1e-6
    )
    assert list(tmp_path.iterdir()) == []


def test_a_cache_dir_that_only_looks_like_off_is_a_folder(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "~/offline-cache")
    found = disk_cache()
    assert found is not None and found.folder == Path("~/offline-cache").expanduser()


# ---------------------------------------------------------------- the folder's bound


def test_the_folder_keeps_the_most_recent_entries_within_its_bound(tmp_path: Path):
    cache = DiskCache(tmp_path, max_bytes=3000)
    keys = [cache_key("entry", str(i)) for i in range(10)]
    for key in keys:
        cache.put(key, bytes(1000))
        time.sleep(0.01)  # distinct modification times
        assert cache.size() <= 3000
    assert cache.get(keys[-1]) == bytes(1000)
    assert cache.get(keys[0]) is None
    assert cache.stats.evicted == 8  # each entry is 1000 bytes and a header


def test_reading_an_entry_keeps_it_from_eviction(tmp_path: Path):
    cache = DiskCache(tmp_path, max_bytes=2400)  # evicted down to 90%: two entries stay
    old, newer, newest = (cache_key(str(i)) for i in range(3))
    cache.put(old, bytes(1000))
    time.sleep(0.01)
    cache.put(newer, bytes(1000))
    time.sleep(0.01)
    assert cache.get(old) is not None  # used: now the most recent
    time.sleep(0.01)
    cache.put(newest, bytes(1000))
    assert cache.get(old) is not None and cache.get(newer) is None


def test_writes_under_the_bound_scan_the_folder_once(tmp_path: Path):
    cache = DiskCache(tmp_path, max_bytes=100_000)
    for i in range(50):
        cache.put(cache_key("under", str(i)), bytes(1000))
    assert cache.stats.scans == 1 and cache.stats.evicted == 0
    for i in range(50, 120):  # past the bound: one scan brings it to 90%, and so on
        cache.put(cache_key("under", str(i)), bytes(1000))
        assert cache.size() <= 100_000
    assert cache.stats.evicted > 0 and cache.stats.scans < 20


FILLER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from mpplug.kernels.compile_cache import DiskCache, cache_key
    cache = DiskCache(Path(sys.argv[1]), max_bytes=1 << 30)
    for i in range(300):
        key = cache_key("shared", str(i % 40))
        cache.put(key, (str(i % 40) * 5000).encode())
        cache.get(key)
    """
)


@pytest.mark.slow
def test_two_processes_filling_one_folder_at_once_leave_every_entry_whole(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    fillers = [
        subprocess.Popen([sys.executable, "-c", FILLER, str(tmp_path)], env=env) for _ in range(2)
    ]
    assert [p.wait(timeout=120) for p in fillers] == [0, 0]
    cache = DiskCache(tmp_path, max_bytes=1 << 30)
    for i in range(40):
        assert cache.get(cache_key("shared", str(i))) == (str(i) * 5000).encode()
    assert cache.stats.refused == 0
    assert not list(tmp_path.glob(".tmp-*"))  # no half-written file left behind


# ---------------------------------------------------------------- in memory


def test_executable_caches_evict_by_weight():
    evicted: list[str] = []
    cache: LRUCache[str, int] = LRUCache(100, evicted.append, weigh=lambda v: v, max_weight=10)
    for key, weight in (("a", 4), ("b", 4), ("c", 4)):
        cache.get_or_create(key, lambda weight=weight: weight)
    assert evicted == ["a"] and cache.weight == 8
    cache.get_or_create("huge", lambda: 50)  # the newest stays even alone over the bound
    assert "huge" in cache and len(cache) == 1 and cache.weight == 50


def test_a_long_compile_logs_its_progress(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    real = jax_exec.prepare_jax_exec

    def slow(pfunc: mp.PFunction, runtime: KernelRuntime) -> None:
        time.sleep(0.3)
        real(pfunc, runtime)

    monkeypatch.setattr(jax_exec.run_jax_exec, "prepare", slow)

    @mp.function
    def prog(x):
        y = mp.run_jax_at(0, lambda v: v * 3.0 + 0.25, x)
        return mp.run_jax_at(0, lambda v: jnp.sin(v) - 7.0, y)

    with caplog.at_level(logging.INFO, logger="mpplug"), mp.Simulator(1) as sim:
        got = sim.fetch(sim.evaluate(prog, sim.put(0, X)), party=0)
    np.testing.assert_allclose(got, np.sin(X * 3.0 + 0.25) - 7.0, rtol=1e-6)
    lines = [r.getMessage() for r in caplog.records if r.name == "mpplug"]
    assert any("of 2 functions" in line for line in lines), lines
    assert any(line.endswith(")") and "compiled 2 functions (" in line for line in lines), lines


def test_an_export_found_in_the_cache_is_not_lowered_again(
    folder: Path, monkeypatch: pytest.MonkeyPatch
):
    from mpplug.frontend import jax_export as export_module

    first = mp.jax_export(f, X, X)[0]
    assert len(entries(folder)) == 1

    def no_lowering(*args: Any) -> Any:
        raise AssertionError("lowered again")

    monkeypatch.setattr(export_module, "_export", no_lowering)
    assert mp.jax_export(f, X, X)[0] == first
    assert disk_cache().stats.hits == 1
    with pytest.raises(AssertionError, match="lowered again"):  # another jaxpr: a miss
        mp.jax_export(f, X[:2], X)
