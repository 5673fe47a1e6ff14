"""Tables at a party on both clusters: datasets declared as tables, put and fetch, SQL, tensor
conversions, PSI, writes; the wire's validation and DuckDB's hardening."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import yaml

import mpplug as mp
from mpplug.config import ClusterSpec
from mpplug.core.graph import Graph
from mpplug.core.types import COLUMN_KINDS
from mpplug.errors import ConfigError, PartyError, SQLError, TraceError, WireError
from mpplug.protos import values_pb2
from mpplug.remote.launch import LocalParties
from mpplug.runtime import codec
from mpplug.tables import arrow, sql
from simulator import Simulator

from .clusters import PARTY_ENV, driven

TIMEOUT = 60.0
RNG = np.random.default_rng(7)
IDS = RNG.choice(10**15, 700, replace=False)
SHARED = IDS[:300]  # alice has IDS[:500], bob IDS[:300] and IDS[500:700]
ALICE = pa.table({"id": IDS[:500][RNG.permutation(500)], "x": RNG.normal(size=500)})
BOB_IDS = np.concatenate([IDS[:300], IDS[500:]])[RNG.permutation(500)]
BOB = pa.table({"id": BOB_IDS, "y": RNG.normal(size=500), "tag": [f"t{i % 7}" for i in range(500)]})


@dataclass
class World:
    folder: Path
    config: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    folder = tmp_path_factory.mktemp("tables")
    pcsv.write_csv(ALICE, folder / "alice.csv")
    pq.write_table(BOB, folder / "bob.parquet")
    data = ClusterSpec.local(["alice", "bob", "carol"]).to_dict()
    alice, bob, _ = data["parties"]
    alice["data"] = {"customers": {"path": "alice.csv", "table": True}}
    alice["outputs"] = {"path": "out_alice", "overwrite": True}
    bob["data"] = {"customers": {"path": "bob.parquet", "table": True}}
    bob["outputs"] = {"path": "out_bob", "overwrite": True}
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump(data))
    return World(folder, config)


@pytest.fixture(scope="module")
def parties(world: World) -> Iterator[LocalParties]:
    """Party processes serving the module's cluster file, killed at the end even on failure."""
    with LocalParties(
        world.config, log_dir=world.folder / "logs", env=PARTY_ENV, fork=True
    ) as running:
        running.start()
        try:
            running.wait_ready(timeout=120.0)
        except BaseException:
            print(f"party logs:\n{running.logs()}", file=sys.stderr)
            raise
        yield running


@pytest.fixture(params=["simulator", "driver"])
def cluster(request: pytest.FixtureRequest, world: World) -> Iterator[mp.Cluster]:
    if request.param == "simulator":
        with Simulator(world.config, timeout=TIMEOUT) as sim:
            yield sim
    else:
        with driven(request.getfixturevalue("parties"), TIMEOUT) as driver:
            yield driver


def test_datasets_intersect_then_sql_then_write(cluster: mp.Cluster, world: World) -> None:
    @mp.function
    def pipeline() -> Any:
        a, b = mp.read("alice", "customers"), mp.read("bob", "customers")
        ia, ib = mp.psi(a, b, key="id")
        scaled = mp.sql("alice", "SELECT id, x * 2 AS x2 FROM t", t=ia)
        kept = mp.sql("bob", "SELECT id, y FROM t WHERE tag <> 't0'", t=ib)
        wrote = (mp.write("alice", "scaled", scaled), mp.write("bob", "kept", kept, format="csv"))
        return ia, ib, scaled, mp.num_rows(ia), wrote

    program = cluster.compile(pipeline)
    assert "table[id:i64, x:f64; 500]" in program.ir()  # a dataset's row count is its type's
    ia, ib, scaled, rows, _ = cluster.evaluate(pipeline)
    got_a, got_b = cluster.fetch(ia, "alice"), cluster.fetch(ib, "bob")
    assert isinstance(got_a, pa.Table) and got_a.schema.names == ["id", "x"]
    assert got_a.column("id").to_pylist() == got_b.column("id").to_pylist()  # one order
    assert sorted(got_a.column("id").to_pylist()) == sorted(SHARED.tolist())
    by_id = dict(zip(ALICE["id"].to_pylist(), ALICE["x"].to_pylist(), strict=True))
    assert got_a.column("x").to_pylist() == [by_id[i] for i in got_a.column("id").to_pylist()]
    assert int(cluster.fetch(rows, "alice")) == 300
    written = pq.read_table(world.folder / "out_alice" / "scaled.parquet")
    assert written.equals(cluster.fetch(scaled, "alice"))
    kept = pcsv.read_csv(world.folder / "out_bob" / "kept.csv")
    tags = dict(zip(BOB["id"].to_pylist(), BOB["tag"].to_pylist(), strict=True))
    expected = [i for i in got_b.column("id").to_pylist() if tags[i] != "t0"]
    assert kept.column("id").to_pylist() == expected


def _every_kind() -> pa.Table:
    numbers = [k for k in COLUMN_KINDS if k not in ("bool", "str")]
    columns = {kind: pa.array([1, 0, None], arrow.arrow_type(kind)) for kind in numbers}
    columns["str"] = pa.array(["ä", None, "x" * 1000])
    columns["bool"] = pa.array([True, None, False])
    return pa.table(columns)


def test_tables_of_every_kind_cross_the_wire_with_nulls(cluster: mp.Cluster) -> None:
    table = _every_kind()
    handle = cluster.put("alice", table)
    assert handle.type.rows == 3 and handle.type.kind("str") == "str"
    moved = cluster.evaluate(mp.function(lambda t: mp.p2p("alice", "carol", t)), handle)
    assert cluster.fetch(moved, "carol").equals(table)


def test_psi_of_three_parties_on_text_keys(cluster: mp.Cluster) -> None:
    keys = [f"user-{i}" for i in range(60)]
    tables = [
        pa.table({"id": keys[:40], "v": range(40)}),
        pa.table({"id": keys[10:][::-1]}),
        pa.table({"id": keys[::2], "w": [1.5] * 30}),
    ]
    handles = [cluster.put(p, t) for p, t in zip(["alice", "bob", "carol"], tables, strict=True)]
    outs = cluster.evaluate(mp.function(lambda *ts: mp.psi(*ts, key="id")), *handles)
    got = [cluster.fetch(h, p) for h, p in zip(outs, ["alice", "bob", "carol"], strict=True)]
    expected = {k for k in keys[10:40] if int(k.split("-")[1]) % 2 == 0}
    assert set(got[0].column("id").to_pylist()) == expected
    assert got[0].column("id") == got[1].column("id") == got[2].column("id")
    assert got[0].column("v").to_pylist() == [
        int(k.split("-")[1]) for k in got[0]["id"].to_pylist()
    ]


def test_a_one_sided_psi_tells_only_the_hub(cluster: mp.Cluster) -> None:
    a = cluster.put("alice", pa.table({"id": [1, 2, 3, 4]}))
    b = cluster.put("bob", pa.table({"id": [4, 3, 9]}))
    one_sided = mp.function(lambda x, y: mp.psi(x, y, key="id", to=["alice"]))
    program = cluster.compile(one_sided, a, b)
    assert len(program.output_types) == 1  # alice's table only
    assert "table[row:i64; ?] @{1}" not in program.ir()  # no positions go to bob
    got, nothing = cluster.evaluate(one_sided, a, b)
    assert nothing is None
    assert sorted(cluster.fetch(got, "alice").column("id").to_pylist()) == [3, 4]
    with pytest.raises(TraceError, match=r"the first \(the hub, 0\) among them"):
        cluster.compile(mp.function(lambda x, y: mp.psi(x, y, to=["bob"])), a, b)


def test_tensors_and_tables_convert_at_the_party(cluster: mp.Cluster) -> None:
    table = pa.table({"a": [1.0, 2.0, 3.0], "b": [4, 5, 6], "s": ["p", "q", "r"]})

    @mp.function
    def convert(t: Any) -> Any:
        x = mp.to_tensor(t, ["a", "b"], dtype="float32")
        back = mp.from_tensor(x * 2, ["a2", "b2"])
        return x, mp.to_tensor(t, "b", dtype="int32"), back

    x, b, back = cluster.evaluate(convert, cluster.put("bob", table))
    np.testing.assert_array_equal(cluster.fetch(x, "bob"), [[1, 4], [2, 5], [3, 6]])
    assert cluster.fetch(b, "bob").dtype == np.int32
    assert cluster.fetch(back, "bob").to_pydict() == {
        "a2": [2.0, 4.0, 6.0],
        "b2": [8.0, 10.0, 12.0],
    }


def test_a_table_from_sql_intersects_once_its_count_is_revealed(cluster: mp.Cluster) -> None:
    a = cluster.put("alice", pa.table({"id": [1, 1, 2, 3, 3, 4]}))  # duplicates: PSI refuses
    b = cluster.put("bob", pa.table({"id": [4, 2, 8]}))

    @mp.function
    def dedupe(t: Any) -> Any:
        distinct = mp.sql("alice", "SELECT DISTINCT id FROM t", t=t)
        return distinct, mp.num_rows(distinct)

    distinct, count = cluster.evaluate(dedupe, a)
    n = int(cluster.fetch(count, "alice"))

    @mp.function
    def intersect(t: Any, u: Any) -> Any:
        return mp.psi(mp.with_rows(t, n), u, key="id")

    ia, ib = cluster.evaluate(intersect, distinct, b)
    assert (
        cluster.fetch(ia, "alice").column("id").to_pylist()
        == cluster.fetch(ib, "bob").column("id").to_pylist()
    )
    assert sorted(cluster.fetch(ib, "bob").column("id").to_pylist()) == [2, 4]
    wrong = mp.function(lambda t: mp.to_tensor(mp.with_rows(t, n + 1), "id"))
    with pytest.raises(PartyError, match=r"has 4 rows here, the program declared 5"):
        cluster.evaluate(wrong, distinct)


def test_a_declared_row_count_is_checked_at_the_party(cluster: mp.Cluster) -> None:
    @mp.function
    def wrong_rows(t: Any) -> Any:
        return mp.to_tensor(mp.sql("alice", "SELECT a FROM t", t=t), rows=5)

    with pytest.raises(PartyError, match="the table has 3 rows here, the program declared 5"):
        cluster.evaluate(wrong_rows, cluster.put("alice", pa.table({"a": [1.0, 2.0, 3.0]})))


def test_duplicate_keys_are_refused_at_their_party(cluster: mp.Cluster) -> None:
    a = cluster.put("alice", pa.table({"id": [1, 2, 2]}))
    b = cluster.put("bob", pa.table({"id": [2, 3]}))
    with pytest.raises(PartyError, match="the key column holds duplicates"):
        cluster.evaluate(mp.function(lambda x, y: mp.psi(x, y, key="id")), a, b)


FORBIDDEN = [
    "SELECT * FROM read_csv('/etc/passwd')",
    "COPY (SELECT 1) TO '/tmp/mpplug-sql-escape.csv'",
    "ATTACH '/tmp/mpplug-sql-escape.db'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SELECT * FROM 'https://example.com/data.csv'",
    "SELECT * FROM glob('/etc/*')",
    "SELECT * FROM RNG",  # a Python object of the caller's module
]


@pytest.mark.parametrize("query", FORBIDDEN)
def test_a_query_cannot_reach_files_extensions_settings_or_python(query: str) -> None:
    with Simulator(ClusterSpec.local(["alice", "bob"]), timeout=TIMEOUT) as sim:
        t = sim.put("alice", pa.table({"a": [1]}))
        with pytest.raises(TraceError, match="DuckDB refused the query"):
            sim.compile(mp.function(lambda t: mp.sql("alice", query, t=t)), t)
        at_party = mp.function(
            lambda t: mp.sql("alice", query, t=t, schema=mp.TableType([("a", "i64")]))
        )
        refused = r"SQLError: party 0, mp\.sql: DuckDB refused the query"
        with pytest.raises(PartyError, match=refused):
            sim.evaluate(at_party, t)
    assert not Path("/tmp/mpplug-sql-escape.csv").exists()
    assert not Path("/tmp/mpplug-sql-escape.db").exists()


def test_misuse_is_a_trace_error_in_the_callers_terms() -> None:
    with Simulator(ClusterSpec.local(["alice", "bob", "carol"]), timeout=TIMEOUT) as sim:
        a = sim.put("alice", pa.table({"id": [1, 2], "s": ["x", "y"]}))
        b = sim.put("bob", pa.table({"id": ["1"]}))
        cases = [
            (lambda x, y: mp.psi(x, x, key="id"), "each table must be at a different party"),
            (lambda x, y: mp.psi(x, y, key="nope"), "no column 'nope'"),
            (lambda x, y: mp.psi(x, y, key="id"), "mix text and integers"),
            (lambda x, y: mp.psi(mp.sql("alice", "SELECT id FROM t", t=x), y), "row count"),
            (lambda x, y: mp.to_tensor(x, "s", rows=2), "column 's' holds text"),
            (lambda x, y: mp.to_tensor(mp.sql("alice", "SELECT id FROM t", t=x)), "give rows="),
            (lambda x, y: mp.run_jax(lambda t: t, x), "JAX takes arrays"),
            (lambda x, y: mp.mpc.seal(x), "cannot be sealed"),
            (lambda x, y: mp.write("alice", "out", x, format="npy"), "parquet or csv"),
        ]
        for fn, message in cases:
            with pytest.raises(TraceError, match=message):
                sim.compile(mp.function(fn), a, b)


def test_a_program_with_tables_is_graph_version_3_and_round_trips() -> None:
    ttype = mp.TableType([("id", "str"), ("x", "f32")], 4)
    program = mp.compile(
        mp.function(lambda: mp.sql(0, "SELECT id FROM t", t=mp.read(0, "d", type=ttype))),
        world_size=2,
    )
    graph = Graph.from_bytes(program.graph.to_bytes())
    assert graph.version == 3 and graph.ir() == program.graph.ir()
    assert "table[id:str; ?]" in graph.ir()


def test_received_table_bytes_are_validated() -> None:
    table = pa.table({"id": ["a", "b"], "x": [1.0, 2.0]})
    wire = codec.to_wire(table)
    assert codec.from_wire(wire, "here").equals(table)
    corrupt = bytearray(wire.data)
    corrupt[len(corrupt) // 2 :] = b"\xff" * (len(corrupt) - len(corrupt) // 2)
    with pytest.raises(WireError, match="not a valid Arrow IPC stream"):
        codec.from_wire(codec.WireValue(wire.header, corrupt), "here")
    other = codec.to_wire(pa.table({"id": ["a"]}))
    claimed = values_pb2.TensorType.FromString(other.header)  # these bytes, another schema
    claimed.table.CopyFrom(values_pb2.TensorType.FromString(wire.header).table)
    with pytest.raises(WireError, match="expected the schema"):
        codec.from_wire(codec.WireValue(claimed.SerializeToString(), other.data), "here")
    with pytest.raises(WireError, match="over the limit"):
        codec.from_wire(wire, "here", max_bytes=16)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"path": "t.parquet"}, "a .parquet dataset is a table: declare 'table: true'"),
        ({"path": "t.npy", "table": True}, "a table is a .csv or .parquet file"),
        ({"path": "t.csv", "table": True, "dtype": "int32"}, "no 'key' or 'dtype'"),
        ({"path": "t.csv", "table": "yes"}, "expected true or false"),
    ],
)
def test_table_datasets_are_declared_plainly(entry: dict[str, Any], message: str) -> None:
    data = ClusterSpec.local(["alice"]).to_dict()
    data["parties"][0]["data"] = {"t": entry}
    with pytest.raises(ConfigError, match=message):
        ClusterSpec.from_dict(data)


def test_a_table_dataset_survives_the_cluster_file_round_trip(world: World) -> None:
    spec = ClusterSpec.from_yaml(world.config)
    again = ClusterSpec.from_dict(spec.to_dict())
    assert [d.table for d in again.parties[1].data] == [True]


def test_a_query_cannot_reach_duckdbs_temporary_folder(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "notes.csv").write_text("a,b\n1,2\n")
    table = pa.table({"a": [1]})
    for query in ("SELECT * FROM read_csv('.tmp/notes.csv')", "SELECT file FROM glob('.tmp/*')"):
        with pytest.raises(SQLError, match="disabled by configuration"):
            sql.run(query, {"t": table}, "here")
    with pytest.raises(SQLError, match="disabled by configuration"):
        sql.run("COPY (SELECT 1 AS v) TO '.tmp/planted.csv'; SELECT 1 AS v", {"t": table}, "here")
    assert sorted(p.name for p in (tmp_path / ".tmp").iterdir()) == ["notes.csv"]


def test_a_csv_tables_columns_can_be_declared(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("id,x\n00123,1\n0042,2\n")
    data = ClusterSpec.local(["alice"]).to_dict()
    entry = {"path": str(tmp_path / "t.csv"), "table": True, "columns": {"id": "str", "x": "f32"}}
    data["parties"][0]["data"] = {"t": entry}
    spec = ClusterSpec.from_dict(data)
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    with Simulator(spec) as sim:
        read = sim.evaluate(mp.function(lambda: mp.read(0, "t")))
        assert sim.fetch(read, 0).to_pydict() == {"id": ["00123", "0042"], "x": [1.0, 2.0]}
    entry["columns"] = {"id": "text"}
    with pytest.raises(ConfigError, match="expected a kind among"):
        ClusterSpec.from_dict(data)
    entry["columns"] = {"nope": "str"}
    with pytest.raises(ConfigError, match=r"declares columns \['nope'\]"):
        Simulator(ClusterSpec.from_dict(data))


def test_a_column_mpplug_cannot_hold_is_named_at_start(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("id,when\n1,2024-01-02\n")
    data = ClusterSpec.local(["alice"]).to_dict()
    data["parties"][0]["data"] = {"t": {"path": str(tmp_path / "t.csv"), "table": True}}
    with pytest.raises(ConfigError, match=r"column 'when' is date32.*CAST it"):
        Simulator(ClusterSpec.from_dict(data))
