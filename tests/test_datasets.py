"""Party-local datasets: `data:` and `outputs:` in the cluster file, `mp.read` / `mp.write`,
the checks a party makes when it starts and every refusal, on the Simulator and on real party
processes (one cluster of three for the whole module), plus `mpplug status` and the memory a
read costs.

The cluster file of the module: alice exposes four datasets (.npy, .npz key, .csv dtype and a
several-MB .npy), bob writes to an outputs directory that allows overwrite, carol to one that
does not. Tests running on both kinds prefix what they write with the kind's name.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml

import mpplug as mp
from mpplug.config import ClusterSpec, DatasetSpec, OutputsSpec
from mpplug.core import TensorType
from mpplug.errors import ConfigError, DatasetError, PartyError, TraceError
from mpplug.kernels.datasets import Datasets
from mpplug.remote.launch import LocalParties
from mpplug.remote.server import PartyServer
from mpplug.remote.status import query_status
from simulator import Simulator

from .clusters import PARTY_ENV, driven, in_process

CLI = [sys.executable, "-m", "mpplug"]
TIMEOUT = 30.0
READY_S = 120.0

FEATURES = np.arange(12, dtype=np.float32).reshape(3, 4)
WEIGHTS = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)
LABELS = np.array([[1, -2], [30, 4], [-5, 60]], dtype=np.int32)
BIG_N = 2 * 2**20  # 8 MiB of float32
BIG = (np.arange(BIG_N, dtype=np.int64) % 1000).astype(np.float32)

EXPOSED = "big, features, labels, weights"


@dataclass
class World:
    folder: Path
    config: Path

    def outputs(self, party: str) -> Path:
        return self.folder / f"out_{party}"


def _world_dict() -> dict[str, Any]:
    """Three parties on free loopback ports; every path relative to the cluster file."""
    data = ClusterSpec.local(["alice", "bob", "carol"]).to_dict()
    alice, bob, carol = data["parties"]
    alice["data"] = {
        "features": "data/features.npy",
        "weights": {"path": "data/weights.npz", "key": "w"},
        "labels": {"path": "data/labels.csv", "dtype": "int32"},
        "big": {"path": "data/big.npy"},
    }
    bob["outputs"] = {"path": "out_bob", "overwrite": True}
    carol["outputs"] = "out_carol"
    return data


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    folder = tmp_path_factory.mktemp("datasets")
    (folder / "data").mkdir()
    np.save(folder / "data" / "features.npy", FEATURES)
    np.savez(folder / "data" / "weights.npz", w=WEIGHTS, unused=np.zeros(5, np.int64))
    (folder / "data" / "labels.csv").write_text(
        "\n".join(",".join(str(v) for v in row) for row in LABELS) + "\n"
    )
    np.save(folder / "data" / "big.npy", BIG)
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump(_world_dict()))
    return World(folder, config)


@pytest.fixture(scope="module")
def parties(world: World) -> Iterator[LocalParties]:
    """The module's party processes, started once and killed at the end, even on failure."""
    with LocalParties(
        world.config, log_dir=world.folder / "logs", env=PARTY_ENV, fork=True
    ) as running:
        running.start()
        try:
            running.wait_ready(timeout=READY_S)
        except BaseException:
            print(f"party logs:\n{running.logs()}", file=sys.stderr)
            raise
        yield running


@pytest.fixture(params=["simulator", "driver"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(kind: str, world: World, request: pytest.FixtureRequest) -> Iterator[mp.Cluster]:
    """The module's cluster file as a Simulator, or a Driver session on its parties."""
    if kind == "simulator":
        with Simulator(world.config, timeout=TIMEOUT) as sim:
            yield sim
    else:
        running = request.getfixturevalue("parties")
        with driven(running, TIMEOUT) as driver:
            yield driver


def _stray_files(folder: Path) -> list[str]:
    """What a write may leave behind besides its <name>.npy: temporary or hidden files."""
    return sorted(
        p.name for p in folder.iterdir() if p.name.startswith(".") or not p.name.endswith(".npy")
    )


# -- read, compute, move, write: Simulator and real parties ----------------------------------
def _score(features: Any, weights: Any, labels: Any) -> Any:
    return features @ weights + labels.sum(axis=1).astype(jnp.float32)


EXPECTED_SCORE = FEATURES @ WEIGHTS + LABELS.sum(axis=1).astype(np.float32)


def test_read_compute_send_and_write(kind: str, cluster: mp.Cluster, world: World):
    name = f"{kind}_score"

    @mp.function
    def score():
        features = mp.read("alice", "features")
        weights = mp.read("alice", "weights")
        labels = mp.read("alice", "labels")
        result = mp.p2p("alice", "carol", mp.run_jax(_score, features, weights, labels))
        return mp.write("carol", name, result), result, labels

    written, result, labels = cluster.evaluate(score)
    assert written.parties == frozenset({2}) and written.type == mp.TensorType("bool")
    assert labels.type == mp.TensorType("int32", (3, 2))
    assert bool(cluster.fetch(written, party="carol")) is True
    np.testing.assert_allclose(cluster.fetch(result, party="carol"), EXPECTED_SCORE)
    np.testing.assert_array_equal(cluster.fetch(labels, party="alice"), LABELS)

    saved = np.load(world.outputs("carol") / f"{name}.npy", allow_pickle=False)
    assert saved.dtype == np.float32 and saved.shape == (3,)
    np.testing.assert_allclose(saved, EXPECTED_SCORE)
    assert _stray_files(world.outputs("carol")) == []
    assert not list(world.outputs("bob").glob(f"{name}*"))  # written where asked only


def test_simulator_takes_a_cluster_file_as_str_path_or_spec(world: World):
    @mp.function
    def features_sum():
        return mp.run_jax(jnp.sum, mp.read("alice", "features"))

    spec = ClusterSpec.from_yaml(world.config)
    for source in (str(world.config), world.config, spec):
        with Simulator(source) as sim:
            assert float(sim.fetch(sim.evaluate(features_sum), party=0)) == FEATURES.sum()


# -- the data never passes through the driver --------------------------------------------
class _Traffic:
    """Counts a Driver's calls by method and the serialized bytes of every request it sends
    and every reply it receives (raw byte streams: the length of each chunk)."""

    def __init__(self, driver: mp.Driver) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.received = 0
        self._lock = threading.Lock()
        driver._stubs = [_Metered(s, self) for s in driver._stubs]
        driver._streams = [_Metered(s, self) for s in driver._streams]

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.sent = self.received = 0

    def count(self, method: str) -> None:
        with self._lock:
            self.calls[method] += 1

    def add(self, message: Any, *, sent: bool) -> None:
        size = _size(message)
        with self._lock:
            if sent:
                self.sent += size
            else:
                self.received += size

    def counting(self, method: str, messages: Iterator[Any]) -> Iterator[Any]:
        for message in messages:
            self.count(method)
            yield message

    def outgoing(self, request: Any) -> Any:
        if _is_message(request):
            self.add(request, sent=True)
            return request
        return self._each(request, sent=True)

    def incoming(self, reply: Any) -> Any:
        if _is_message(reply):
            self.add(reply, sent=False)
            return reply
        return self._each(reply, sent=False)

    def _each(self, messages: Iterator[Any], *, sent: bool) -> Iterator[Any]:
        for message in messages:
            self.add(message, sent=sent)
            yield message

    def settled(self, call: Any) -> None:
        if not call.cancelled() and call.exception() is None:
            self.add(call.result(), sent=False)


def _is_message(value: Any) -> bool:
    return isinstance(value, bytes | bytearray | memoryview) or hasattr(value, "ByteSize")


def _size(message: Any) -> int:
    if isinstance(message, memoryview):
        return message.nbytes
    if isinstance(message, bytes | bytearray):
        return len(message)
    return int(message.ByteSize())


class _Metered:
    def __init__(self, stub: Any, traffic: _Traffic) -> None:
        self._stub, self._traffic = stub, traffic

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        traffic = self._traffic

        class Method:
            def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
                traffic.count(name)
                if name == "ExecuteStream":  # each execution sent on it counts as an Execute
                    request = traffic.counting("Execute", request)
                return traffic.incoming(method(traffic.outgoing(request), *args, **kwargs))

            def future(self, request: Any, *args: Any, **kwargs: Any) -> Any:
                traffic.count(name)
                call = method.future(traffic.outgoing(request), *args, **kwargs)
                call.add_done_callback(traffic.settled)
                return call

        return Method()


def test_dataset_bytes_never_pass_through_the_driver(parties: LocalParties, world: World):
    @mp.function
    def big_sum():
        big = mp.p2p("alice", "bob", mp.read("alice", "big"))  # 8 MiB party to party
        total = mp.run_jax(lambda x: jnp.sum(x.astype(jnp.float32)), big)
        return mp.write("bob", "driver_big_sum", total), total

    with driven(parties, TIMEOUT) as driver:
        traffic = _Traffic(driver)
        traffic.reset()
        written, total = driver.evaluate(big_sum)
        calls, moved = dict(traffic.calls), traffic.sent + traffic.received
        print(
            f"\ndriver traffic during evaluate: calls {calls}, sent {traffic.sent} B, "
            f"received {traffic.received} B; dataset {BIG.nbytes} B "
            f"({100 * moved / BIG.nbytes:.2f}%)"
        )
        assert not {"Put", "PutSmall", "Fetch"} & set(calls), calls
        assert calls.get("DatasetInfo") == 1 and calls.get("Execute") == 2, calls  # alice, bob
        assert traffic.sent > 0 and traffic.received > 0
        assert moved < 0.05 * BIG.nbytes, (moved, BIG.nbytes)

        traffic.reset()
        assert float(driver.fetch(total, party="bob")) == pytest.approx(BIG.sum(dtype=np.float64))
        assert not traffic.calls  # the f32 scalar came back with bob's Execute reply
        assert bool(driver.fetch(written, party="bob")) is True
    saved = np.load(world.outputs("bob") / "driver_big_sum.npy")
    assert saved.shape == () and float(saved) == pytest.approx(BIG.sum(dtype=np.float64))


# -- refusals inside programs ----------------------------------------------------------------
def test_an_undeclared_dataset_is_a_trace_error_listing_the_exposed_names(cluster: mp.Cluster):
    with pytest.raises(TraceError) as caught:
        cluster.evaluate(mp.function(lambda: mp.read("alice", "secrets")))
    assert str(caught.value) == (
        f"mp.read('alice', 'secrets'): party alice exposes no dataset 'secrets'; "
        f"it exposes: {EXPOSED}"
    )
    with pytest.raises(TraceError, match=r"party bob exposes no dataset 'x'; it exposes: none$"):
        cluster.evaluate(mp.function(lambda: mp.read(1, "x")))


@pytest.mark.parametrize("name", ["../secret", "/etc/passwd", "data/features.npy", "a.npy", ""])
def test_a_path_is_never_a_dataset_name(cluster: mp.Cluster, world: World, name: str):
    with pytest.raises(TraceError) as caught:
        cluster.evaluate(mp.function(lambda: mp.read("alice", name)))
    assert str(caught.value) == (
        f"mp.read('alice', {name!r}): a dataset name is a letter then up to 63 letters, "
        f"digits, '_' or '-' (programs name datasets, never paths)"
    )

    with pytest.raises(TraceError) as caught:
        cluster.evaluate(
            mp.function(lambda: mp.write("carol", name, mp.p2p(0, 2, mp.read(0, "features"))))
        )
    assert str(caught.value) == (
        f"mp.write('carol', {name!r}): an output name is a letter then up to 63 letters, "
        f"digits, '_' or '-' (programs name outputs, never paths)"
    )
    assert not (world.folder / "secret.npy").exists()
    assert not (world.folder / "secret").exists()


def test_names_are_checked_even_when_tracing_without_a_cluster():
    f32 = mp.TensorType("float32", (3,))
    for bad in ("../x", "/etc/passwd"):
        with pytest.raises(TraceError, match="programs name datasets, never paths"):
            mp.compile(mp.function(lambda bad=bad: mp.read(0, bad, type=f32)), world_size=2)
    with pytest.raises(TraceError, match=r"tracing without a cluster; give the dataset's type="):
        mp.compile(mp.function(lambda: mp.read(0, "x")), world_size=2)
    program = mp.compile(mp.function(lambda: mp.read(1, "x", type=f32)), world_size=2)
    assert program.output_types == [(f32, frozenset({1}))]


def test_write_needs_the_value_at_the_writing_party(cluster: mp.Cluster):
    with pytest.raises(TraceError) as caught:
        cluster.evaluate(mp.function(lambda: mp.write("carol", "x", mp.read("alice", "labels"))))
    assert str(caught.value) == (
        "mp.write('carol', 'x'): the value is held by {0}, not by party 2; "
        "move it first with mp.p2p"
    )


def test_a_party_without_outputs_refuses_writes(kind: str, cluster: mp.Cluster):
    with pytest.raises(PartyError) as caught:
        cluster.evaluate(mp.function(lambda: mp.write("alice", kind, mp.read("alice", "labels"))))
    assert caught.value.party == 0 and caught.value.error_type == "DatasetError"
    assert caught.value.message == f"party alice has no outputs directory to write {kind!r} to"


def _copy_features(party: str, name: str, scale: float = 1.0) -> Any:
    @mp.function
    def copy():
        features = mp.read("alice", "features")
        return mp.write(
            party, name, mp.p2p("alice", party, mp.run_jax(lambda x: x * scale, features))
        )

    return copy


@pytest.mark.parametrize("party", ["carol", "bob"])  # bob's outputs allow overwrite
def test_a_symlink_at_the_target_is_refused(
    kind: str, cluster: mp.Cluster, world: World, party: str
):
    outside = world.folder / f"outside-{kind}-{party}"
    outside.mkdir()
    secret = outside / "secret.npy"
    np.save(secret, np.array([7, 7, 7], np.int64))
    before = secret.read_bytes()
    dangling = outside / "not-there.npy"

    for name, points_to in ((f"{kind}_link", secret), (f"{kind}_dangling", dangling)):
        link = world.outputs(party) / f"{name}.npy"
        link.symlink_to(points_to)
        with pytest.raises(PartyError) as caught:
            cluster.evaluate(_copy_features(party, name))
        assert caught.value.error_type == "DatasetError"
        assert caught.value.message == f"party {party}: {link} is a symlink; it is never written"
        assert link.is_symlink() and os.readlink(link) == str(points_to)
    assert secret.read_bytes() == before
    assert not dangling.exists()
    assert sorted(p.name for p in outside.iterdir()) == ["secret.npy"]
    assert _stray_files(world.outputs(party)) == []


def test_overwrite_is_refused_unless_the_outputs_allow_it(
    kind: str, cluster: mp.Cluster, world: World
):
    kept = world.outputs("carol") / f"{kind}_once.npy"
    cluster.evaluate(_copy_features("carol", f"{kind}_once"))
    with pytest.raises(PartyError) as caught:
        cluster.evaluate(_copy_features("carol", f"{kind}_once", 2.0))
    assert caught.value.party == 2 and caught.value.error_type == "DatasetError"
    assert caught.value.message == (
        f"party carol: {kept} exists and its outputs do not allow overwrite"
    )
    np.testing.assert_array_equal(np.load(kept), FEATURES)  # the first write stays

    replaced = world.outputs("bob") / f"{kind}_again.npy"
    for scale in (1.0, 3.0, -1.0):
        written = cluster.evaluate(_copy_features("bob", f"{kind}_again", scale))
        assert bool(cluster.fetch(written, party="bob")) is True
        np.testing.assert_array_equal(np.load(replaced), FEATURES * scale)
    for party in ("bob", "carol"):
        assert _stray_files(world.outputs(party)) == []


def test_writes_leave_no_temporary_files(kind: str, cluster: mp.Cluster, world: World):
    @mp.function
    def several():
        labels = mp.p2p("alice", "carol", mp.read("alice", "labels"))
        weights = mp.p2p("alice", "carol", mp.read("alice", "weights"))
        flags = [
            mp.write("carol", f"{kind}_many_{i}", mp.run_jax(lambda x, i=i: x + i, labels))
            for i in range(4)
        ]
        return [*flags, mp.write("carol", f"{kind}_weights", weights)]

    carol = world.outputs("carol")
    assert all(bool(cluster.fetch(flag, party=2)) for flag in cluster.evaluate(several))
    for i in range(4):
        np.testing.assert_array_equal(np.load(carol / f"{kind}_many_{i}.npy"), LABELS + i)
    np.testing.assert_array_equal(np.load(carol / f"{kind}_weights.npy"), WEIGHTS)
    assert _stray_files(carol) == []

    with pytest.raises(PartyError, match="exists and its outputs do not allow overwrite"):
        cluster.evaluate(several)
    assert _stray_files(carol) == []
    np.testing.assert_array_equal(np.load(carol / f"{kind}_many_0.npy"), LABELS)


def test_a_bfloat16_write_is_refused_or_keeps_its_dtype(tmp_path: Path):
    spec = ClusterSpec.from_dict(
        {"parties": [{"name": "alice", "endpoint": "127.0.0.1:1", "outputs": "out"}]},
        base_dir=tmp_path,
    )

    @mp.function
    def halves():
        return mp.write(
            "alice", "h", mp.run_jax_at("alice", lambda: jnp.full(3, 0.5, jnp.bfloat16))
        )

    with Simulator(spec) as sim:
        try:
            sim.evaluate(halves)
        except (TraceError, PartyError) as exc:
            assert "bfloat16" in str(exc) or "bf16" in str(exc), str(exc)
            return  # refused, naming the type: correct
    saved = np.load(tmp_path / "out" / "h.npy", allow_pickle=False)
    assert saved.dtype == ml_dtypes.bfloat16, f"written as {saved.dtype}"


# -- files checked when a party starts -----------------------------------------------------
def _spec_with(folder: Path, data: dict[str, Any]) -> ClusterSpec:
    """alice exposes `data` (paths relative to `folder`); bob exposes nothing."""
    alice = {"name": "alice", "endpoint": "127.0.0.1:1", "data": data}
    return ClusterSpec.from_dict(
        {"parties": [alice, {"name": "bob", "endpoint": "127.0.0.1:2"}]}, base_dir=folder
    )


@pytest.mark.parametrize(
    ("text", "dtype", "problem"),
    [
        ("1,2\n3,x\n", "int32", "could not convert string 'x' to int32"),
        ("1.5,2\n", "int64", "could not convert string '1.5' to int64"),
        ("255,256\n", "uint8", "could not convert string '256' to uint8"),
        ("-1\n", "uint16", "could not convert string '-1' to uint16"),
        ("1,2\n3\n", "float32", "the number of columns changed from 2 to 1"),
        ("a,b\n1,2\n", "float64", "could not convert string 'a' to float64"),
        pytest.param(
            "",
            "int32",
            "it holds no numbers",
            marks=pytest.mark.filterwarnings("ignore:loadtxt. input contained no data"),
        ),
    ],
)
def test_a_csv_that_does_not_parse_as_its_dtype_stops_the_simulator(
    tmp_path: Path, text: str, dtype: str, problem: str
):
    (tmp_path / "bad.csv").write_text(text)
    spec = _spec_with(tmp_path, {"table": {"path": "bad.csv", "dtype": dtype}})
    with pytest.raises(ConfigError) as caught:
        Simulator(spec)
    message = str(caught.value)
    assert message.startswith(
        f"party alice, dataset 'table' ({tmp_path / 'bad.csv'}): cannot be read: "
    ), message
    assert problem in message


def test_a_csv_parses_as_its_declared_dtype(tmp_path: Path):
    (tmp_path / "t.csv").write_text("1,2,3\n4,5,6\n")
    (tmp_path / "col.csv").write_text("7\n8\n")
    data = {
        "t16": {"path": "t.csv", "dtype": "uint16"},
        "tf": {"path": "t.csv", "dtype": "float64"},
        "col": {"path": "col.csv", "dtype": "int8"},
    }
    datasets = Datasets("alice", _spec_with(tmp_path, data).party("alice").data)
    assert {k: str(v) for k, v in datasets.types().items()} == {
        "t16": "u16[2,3]",
        "tf": "f64[2,3]",
        "col": "i8[2]",
    }
    loaded = datasets.load("tf", datasets.info("tf"))
    assert loaded.dtype == np.float64
    np.testing.assert_array_equal(loaded, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(datasets.load("col", datasets.info("col")), [7, 8])


def test_a_missing_data_file_stops_the_simulator_and_the_party_server(tmp_path: Path):
    np.save(tmp_path / "here.npy", np.zeros(3))
    spec = _spec_with(tmp_path, {"here": "here.npy", "gone": "sub/gone.npy"})
    expected = (
        f"party alice, dataset 'gone' ({tmp_path / 'sub' / 'gone.npy'}): the file does not exist"
    )
    with pytest.raises(ConfigError) as caught:
        Simulator(spec)
    assert str(caught.value) == expected
    with pytest.raises(ConfigError) as caught:
        PartyServer(spec, "alice")
    assert str(caught.value) == expected
    PartyServer(spec, "bob")  # a party checks only its own files; never started

    (tmp_path / "sub" / "gone.npy").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"'gone' .*: the file is not a file$"):
        Simulator(spec)


def test_mpplug_serve_reports_a_missing_data_file_as_one_error_line(tmp_path: Path):
    config = tmp_path / "cluster.yaml"
    data = ClusterSpec.local(["alice", "bob"]).to_dict()
    data["parties"][0]["data"] = {"gone": "gone.npy"}
    config.write_text(yaml.safe_dump(data))
    done = subprocess.run(
        [*CLI, "serve", "--config", str(config), "--party", "alice"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("mpplug")]
    assert ours == [
        f"mpplug: error: party alice, dataset 'gone' ({tmp_path / 'gone.npy'}): "
        f"the file does not exist"
    ], done.stderr


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p.write_bytes(b"not an npy file"), "cannot be read: "),
        (lambda p: np.save(p, np.array([{}], dtype=object)), "cannot be read: "),
        (lambda p: np.save(p, np.array(["a", "b"])), "expected one of bool, int8"),
        (lambda p: np.save(p, np.zeros(2, ">f4")), "expected one of bool, int8"),
    ],
    ids=["garbage", "pickled-objects", "strings", "big-endian"],
)
def test_an_unreadable_npy_is_a_config_error(tmp_path: Path, make: Any, problem: str):
    make(tmp_path / "f.npy")
    spec = _spec_with(tmp_path, {"f": "f.npy"})
    with pytest.raises(ConfigError) as caught:
        Simulator(spec)
    message = str(caught.value)
    assert message.startswith(f"party alice, dataset 'f' ({tmp_path / 'f.npy'}): "), message
    assert problem in message


def test_an_npz_without_the_key_or_not_a_zip_is_a_config_error(tmp_path: Path):
    np.savez(tmp_path / "w.npz", a=np.zeros(2), b=np.ones(3))
    with pytest.raises(
        ConfigError, match=r"cannot be read: .*no array 'c' in it; it has \['a', 'b'\]"
    ):
        Simulator(_spec_with(tmp_path, {"w": {"path": "w.npz", "key": "c"}}))
    (tmp_path / "z.npz").write_bytes(b"PK not really")
    with pytest.raises(ConfigError, match=r"dataset 'z' .*: cannot be read: "):
        Simulator(_spec_with(tmp_path, {"z": {"path": "z.npz", "key": "a"}}))
    datasets = Datasets(
        "alice", _spec_with(tmp_path, {"w": {"path": "w.npz", "key": "b"}}).party(0).data
    )
    np.testing.assert_array_equal(datasets.load("w", TensorType(np.dtype("float64"), (3,))), 1.0)


# -- the cluster file --------------------------------------------------------------------
def test_data_and_outputs_paths_resolve_against_the_cluster_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    folder = tmp_path / "conf"
    folder.mkdir()
    config = folder / "cluster.yaml"
    data = ClusterSpec.local(["alice", "bob"]).to_dict()
    data["parties"][0]["data"] = {
        "f": "f.npy",
        "w": {"path": "../w.npz", "key": "k"},
        "t": {"path": "/abs/t.csv", "dtype": "float32"},
    }
    data["parties"][0]["outputs"] = "results"
    data["parties"][1]["outputs"] = {"path": "res", "overwrite": True}
    config.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # not the cluster file's folder
    spec = ClusterSpec.from_yaml("conf/cluster.yaml")
    alice, bob = spec.parties
    assert {d.name: d for d in alice.data} == {
        "f": DatasetSpec("f", folder.resolve() / "f.npy"),
        "w": DatasetSpec("w", tmp_path.resolve() / "w.npz", key="k"),
        "t": DatasetSpec("t", Path("/abs/t.csv"), dtype="float32"),
    }
    assert alice.outputs == OutputsSpec(folder.resolve() / "results", overwrite=False)
    assert bob.outputs == OutputsSpec(folder.resolve() / "res", overwrite=True)
    assert bob.data == ()
    assert ClusterSpec.from_dict(spec.to_dict()) == spec  # to_dict keeps absolute paths
    direct = ClusterSpec.from_dict(data, base_dir=folder).party("alice")
    assert set(direct.data) == set(alice.data) and direct.outputs == alice.outputs


def _party_with(**fields: Any) -> dict[str, Any]:
    return {"parties": [{"name": "alice", "endpoint": "127.0.0.1:1", **fields}]}


AT = "cluster.parties[0]"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"data": {"../x": "x.npy"}}, f"{AT}.data.../x: a dataset name is a letter then up to 63"),
        ({"data": {"a.b": "x.npy"}}, f"{AT}.data.a.b: a dataset name is a letter"),
        ({"data": {"9x": "x.npy"}}, f"{AT}.data.9x: a dataset name is a letter"),
        ({"data": {"x" * 65: "x.npy"}}, f"{AT}.data.{'x' * 65}: a dataset name is a letter"),
        ({"data": {7: "x.npy"}}, f"{AT}.data.7: a dataset name is a letter"),
        ({"data": {"w": "w.npz"}}, f"{AT}.data.w.key: a .npz dataset names its array with 'key'"),
        (
            {"data": {"f": {"path": "f.npy", "key": "a"}}},
            f"{AT}.data.f.key: only a .npz dataset takes 'key', got 'a'",
        ),
        (
            {"data": {"t": "t.csv"}},
            f"{AT}.data.t.dtype: a .csv dataset declares its element type with 'dtype'",
        ),
        (
            {"data": {"t": {"path": "t.csv", "dtype": "complex64"}}},
            f"{AT}.data.t.dtype: expected one of ['float16', 'float32', 'float64', 'int16', "
            "'int32', 'int64', 'int8', 'uint16', 'uint32', 'uint64', 'uint8'], got 'complex64'",
        ),
        (
            {"data": {"t": {"path": "t.csv", "dtype": "float"}}},
            f"{AT}.data.t.dtype: expected one of [",
        ),
        (
            {"data": {"f": {"path": "f.npy", "dtype": "int32"}}},
            f"{AT}.data.f.dtype: only a .csv dataset takes 'dtype', got 'int32'",
        ),
        (
            {"data": {"f": {"path": "f.npy", "mmap": True}}},
            f"{AT}.data.f: unknown key(s) ['mmap']; "
            "expected ['columns', 'dtype', 'key', 'path', 'table']",
        ),
        ({"data": {"f": "f.txt"}}, f"{AT}.data.f.path: expected a .npy, .npz, .csv file"),
        ({"data": {"f": {"key": "k"}}}, f"{AT}.data.f.path: expected a file path, got None"),
        ({"data": {"f": ""}}, f"{AT}.data.f.path: expected a file path, got ''"),
        ({"data": {"f": 3}}, f"{AT}.data.f: expected a file path or a mapping with 'path'"),
        ({"data": ["f.npy"]}, f"{AT}.data: expected a mapping of dataset names to files"),
        (
            {"outputs": {"path": "out", "overwrite": "yes"}},
            f"{AT}.outputs.overwrite: expected true or false, got 'yes'",
        ),
        (
            {"outputs": {"path": "out", "mode": 384}},
            f"{AT}.outputs: unknown key(s) ['mode']; expected ['overwrite', 'path']",
        ),
        ({"outputs": {"overwrite": True}}, f"{AT}.outputs.path: expected a directory path"),
        ({"outputs": 5}, f"{AT}.outputs: expected a directory path or a mapping with 'path'"),
        ({"datasets": {"f": "f.npy"}}, f"{AT}: unknown key(s) ['datasets']"),
    ],
)
def test_config_errors_name_the_field(fields: dict[str, Any], message: str):
    with pytest.raises(ConfigError) as caught:
        ClusterSpec.from_dict(_party_with(**fields))
    assert str(caught.value).startswith(message), str(caught.value)


def test_dataset_names_may_use_the_whole_pattern():
    names = ["a", "A9", "x_y-z", "z" * 64]
    spec = ClusterSpec.from_dict(_party_with(data={n: f"{n}.npy" for n in names}))
    assert [d.name for d in spec.party(0).data] == names


@pytest.mark.parametrize("dtype", [["int32"], {"name": "int32"}], ids=["list", "mapping"])
def test_an_unhashable_csv_dtype_is_a_config_error(dtype: Any):
    with pytest.raises(ConfigError, match=rf"{re.escape(AT)}\.data\.t\.dtype: expected one of "):
        ClusterSpec.from_dict(_party_with(data={"t": {"path": "t.csv", "dtype": dtype}}))


# -- the Datasets object itself ------------------------------------------------------------
def test_datasets_info_load_and_refusals(world: World, tmp_path: Path):
    spec = ClusterSpec.from_yaml(world.config)
    alice = Datasets("alice", spec.party("alice").data, spec.party("alice").outputs)
    assert {k: str(v) for k, v in alice.types().items()} == {
        "features": "f32[3,4]",
        "weights": "f32[4]",
        "labels": "i32[3,2]",
        "big": f"f32[{BIG_N}]",
    }
    big = alice.load("big", alice.info("big"))
    assert isinstance(big, np.memmap) and big.mode == "r"  # memory-mapped, read-only
    np.testing.assert_array_equal(big[:5], BIG[:5])
    np.testing.assert_array_equal(alice.load("weights", alice.info("weights")), WEIGHTS)
    np.testing.assert_array_equal(alice.load("labels", alice.info("labels")), LABELS)

    with pytest.raises(
        DatasetError, match=rf"party alice exposes no dataset 'nope'; it exposes: {EXPOSED}$"
    ):
        alice.info("nope")
    for bad in ("../features", "/etc/passwd", "features.npy", 3):
        with pytest.raises(
            DatasetError, match=r"cannot read .*\(programs name datasets, never paths\)$"
        ):
            alice.info(bad)
    with pytest.raises(DatasetError, match=r"traced for f32\[4\]; trace it again"):
        alice.load("features", TensorType(np.dtype("float32"), (4,)))
    with pytest.raises(DatasetError, match=r"party alice has no outputs directory to write 'x' to"):
        alice.write("x", np.zeros(2))

    out = Datasets("bob", (), OutputsSpec(tmp_path / "new" / "out"))
    assert (tmp_path / "new" / "out").is_dir()  # created at start
    for bad in ("../x", "/tmp/x", "x.npy", "a/b", ""):
        with pytest.raises(
            DatasetError, match=r"cannot write .*\(programs name datasets, never paths\)$"
        ):
            out.write(bad, np.zeros(2))
    assert list((tmp_path / "new").iterdir()) == [tmp_path / "new" / "out"]
    assert list((tmp_path / "new" / "out").iterdir()) == []


def test_a_dataset_changed_after_tracing_is_refused(tmp_path: Path):
    np.save(tmp_path / "f.npy", np.ones(4, np.float32))
    spec = _spec_with(tmp_path, {"f": "f.npy"})

    @mp.function
    def total():
        return mp.run_jax(jnp.sum, mp.read("alice", "f"))

    with Simulator(spec) as sim:
        assert float(sim.fetch(sim.evaluate(total), party=0)) == 4.0
        np.save(tmp_path / "f.npy", np.ones(5, np.float32))  # same name, new shape
        with pytest.raises(PartyError) as caught:
            sim.evaluate(total)
    assert caught.value.error_type == "DatasetError"
    assert caught.value.message == (
        "party alice: dataset 'f' is f32[5] now, but the program was traced for f32[4]; "
        "trace it again"
    )


def test_a_write_that_fails_midway_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "out"
    datasets = Datasets("carol", (), OutputsSpec(folder))
    with pytest.raises(ValueError, match="pickle"):
        datasets.write("objects", np.array([{}], dtype=object))  # np.save refuses
    assert list(folder.iterdir()) == []

    # Someone else takes the name between the check and the link: refused, nothing left over.
    real_link = os.link

    def racing_link(src: Any, dst: Any) -> None:
        Path(dst).write_bytes(b"theirs")
        real_link(src, dst)

    monkeypatch.setattr(os, "link", racing_link)
    with pytest.raises(
        DatasetError, match=r"race\.npy exists and its outputs do not allow overwrite"
    ):
        datasets.write("race", np.arange(3))
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["race.npy"]
    assert (folder / "race.npy").read_bytes() == b"theirs"

    assert datasets.write("fine", np.arange(3)) == folder / "fine.npy"
    np.testing.assert_array_equal(np.load(folder / "fine.npy"), np.arange(3))
    assert sorted(p.name for p in folder.iterdir()) == ["fine.npy", "race.npy"]


# -- mpplug status ---------------------------------------------------------------------------
def test_status_lists_each_partys_datasets(parties: LocalParties, world: World):
    text = subprocess.run(
        [*CLI, "status", "--config", str(world.config)], capture_output=True, text=True, timeout=120
    )
    assert text.returncode == 0, text.stdout + text.stderr
    tables = text.stdout.split("\n\n")
    assert len(tables) == 2, text.stdout
    rows = [line.split() for line in tables[1].strip().splitlines()]
    assert rows == [
        ["party", "dataset", "type"],
        ["alice", "big", f"f32[{BIG_N}]"],
        ["alice", "features", "f32[3,4]"],
        ["alice", "labels", "i32[3,2]"],
        ["alice", "weights", "f32[4]"],
    ], text.stdout
    assert [line.split()[0] for line in tables[0].strip().splitlines()[1:]] == [
        "alice",
        "bob",
        "carol",
    ]

    done = subprocess.run(
        [*CLI, "status", "--config", str(world.config), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["party"], r["health"], r["datasets"]) for r in records] == [
        (
            "alice",
            "SERVING",
            {
                "big": f"f32[{BIG_N}]",
                "features": "f32[3,4]",
                "labels": "i32[3,2]",
                "weights": "f32[4]",
            },
        ),
        ("bob", "SERVING", {}),
        ("carol", "SERVING", {}),
    ]


def test_status_of_a_party_without_datasets_lists_none():
    spec = ClusterSpec.local(["alice"])
    with in_process(spec):
        status = query_status(spec, "alice", timeout=5.0)
    assert status.serving and status.datasets == ()


# -- memory: a read is memory-mapped and copied at most once ---------------------------------
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import jax.numpy as jnp
    import mpplug as mp
    from mpplug.config import ClusterSpec
    from simulator import Simulator

    folder = Path(sys.argv[1])
    spec = ClusterSpec.from_dict(
        {"parties": [
            {"name": "alice", "endpoint": "127.0.0.1:1", "data": {"big": "big.npy"}},
            {"name": "bob", "endpoint": "127.0.0.1:2"},
        ]},
        base_dir=folder,
    )

    def status_kib(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])

    def rss_kib():
        return status_kib("VmRSS")

    def peak_kib():
        # VmHWM since the last reset; getrusage's ru_maxrss would include the RSS of the
        # process that forked this one (Linux carries it across exec)
        return status_kib("VmHWM")

    @mp.function
    def total():
        return mp.run_jax(jnp.sum, mp.read("alice", "big"))

    with Simulator(spec) as sim:
        small = sim.put(0, jnp.ones(4))  # JAX and XLA warm up before measuring
        sim.fetch(sim.evaluate(mp.function(lambda v: mp.run_jax(jnp.sum, v)), small), party=0)
        peak_before = peak_kib()
        try:  # the peak restarts from the RSS now (where the kernel allows it)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        before = rss_kib()
        out = sim.evaluate(total)
        value = float(sim.fetch(out, party=0))
        peak = peak_kib()
    print(json.dumps({"before_kib": before, "peak_before_kib": peak_before,
                      "peak_kib": peak, "sum": value}))
    """
)


def test_reading_a_large_dataset_copies_it_at_most_once(tmp_path: Path):
    n = 256 * 2**20 // 4
    path = tmp_path / "big.npy"
    with open(path, "wb") as out:  # written in chunks: this process never holds 256 MiB
        np.lib.format.write_array_header_1_0(
            out, {"descr": "<f4", "fortran_order": False, "shape": (n,)}
        )
        chunk = np.ones(2**22, np.float32)
        for _ in range(n // chunk.size):
            out.write(chunk.tobytes())
    file_kib = path.stat().st_size / 1024
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    growth = found["peak_kib"] - found["before_kib"]
    print(
        f"\nmemory: file {file_kib / 1024:.0f} MiB; RSS before evaluate "
        f"{found['before_kib'] / 1024:.0f} MiB (peak so far {found['peak_before_kib'] / 1024:.0f}"
        f" MiB); peak after {found['peak_kib'] / 1024:.0f} MiB; growth {growth / 1024:.0f} MiB "
        f"= {growth / file_kib:.2f} x the file"
    )
    assert found["sum"] == pytest.approx(n, rel=1e-6)
    assert growth < 1.6 * file_kib, found
