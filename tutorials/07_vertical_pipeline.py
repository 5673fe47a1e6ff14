"""Tutorial 7: from three parties' CSV files to a jointly trained model, without sharing a row.

Alice and Bob hold different features of their customers (`customers_a.csv`: an id and 8
columns; `customers_b.csv`: an id and 8 others) and Carol holds a label for hers
(`labels.csv`: an id and a 0/1 label). Their customer lists overlap only in part, come in
different orders, and none of them may tell the others who its other customers are. Each
file is a table dataset in the cluster file (`table: true`), and the pipeline is two programs:

1. `align`: each party reads its table; private set intersection (`mp.psi(a, b, c,
   key="id")`) keeps, at each party, only the rows of the customers all three hold, in one
   order common to all three; each party then standardizes its own columns with SQL
   (`mp.sql`, DuckDB at the party) over those customers. The driver is told how many
   customers that is (`mp.num_rows`, fetched): the arrays of the next program need a shape
   the program knows, and a PSI's row count is decided at the parties.
2. `train`: the tables become arrays (`mp.to_tensor`), are sealed, and a logistic regression
   is trained on the shares with tutorial 05's plain-JAX step, all epochs in one
   `mp.fori_loop`; the weights are revealed to Alice and Bob only, and each writes them to
   its outputs folder as a one-row table, `model.csv` (`mp.from_tensor`, `mp.write`).

The data are synthetic: the script writes the three files and the cluster file into a
temporary folder. The yardstick joins the files by id in plaintext, as one trusted party
holding all of them would, and trains the same model: the secure model's accuracy on the
joined customers must be within one point of it.

What to notice: the driver (this script) learns the tables' columns, the files' row counts
and, after step 1, the number of shared customers; never an id or a row. Bob and Carol learn
only which of their customers all three share (and how many customers each party has);
Alice, the first table's party, is the hub of the protocol and also learns which of her
customers Bob has and which Carol has (docs/tables.md says exactly who learns what). The
programs run on the Simulator here; `run_pipeline` takes any cluster, and the tests run it
on three real party processes started from the same cluster file.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import yaml

import mpplug as mp
from mpplug.config import ClusterSpec

SEED = 7
CUSTOMERS = 3_000  # all the ids there are
HELD = 0.8  # each party has about this share of them: about half are shared by all three
FILES = {"alice": "customers_a.csv", "bob": "customers_b.csv", "carol": "labels.csv"}
FEATURES_A = [f"a{i}" for i in range(8)]
FEATURES_B = [f"b{i}" for i in range(8)]
MODEL_COLUMNS = [*FEATURES_A, *FEATURES_B, "bias"]
EPOCHS = 15
LEARNING_RATE = 1.0
TOLERANCE = 0.01  # the secure model's accuracy may differ by one point at most

Params = dict[str, Any]
Array = np.ndarray[Any, Any]


def write_data(folder: Path) -> Path:
    """Write the parties' CSV files into `folder` and a cluster file that gives each party
    its file as the table dataset "customers" and an outputs folder; return its path.

    Every customer has 16 features on arbitrary scales and a label drawn from a logistic model
    of them; each party keeps its own random subset of the customers, shuffled."""
    rng = np.random.default_rng(SEED)
    ids = np.array([f"cust-{i:05d}" for i in range(CUSTOMERS)])
    z = rng.normal(size=(CUSTOMERS, 16))
    features = z * rng.uniform(0.5, 20.0, size=16) + rng.uniform(-50.0, 100.0, size=16)
    chance = 1.0 / (1.0 + np.exp(-(z @ rng.normal(size=16) + 0.5)))
    columns = {
        "alice": dict(zip(FEATURES_A, features[:, :8].T, strict=True)),
        "bob": dict(zip(FEATURES_B, features[:, 8:].T, strict=True)),
        "carol": {"label": (rng.random(CUSTOMERS) < chance).astype(np.int64)},
    }
    cluster = ClusterSpec.local(list(FILES)).to_dict()  # three parties on free local ports
    for party in cluster["parties"]:
        name = party["name"]
        kept = rng.permutation(np.flatnonzero(rng.random(CUSTOMERS) < HELD))
        table = {"id": ids[kept]} | {k: v[kept] for k, v in columns[name].items()}
        pcsv.write_csv(pa.table(table), folder / FILES[name])
        party["data"] = {"customers": {"path": FILES[name], "table": True}}
        party["outputs"] = f"outputs_{name}"
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump(cluster, sort_keys=False))
    return config


# -- the model: tutorial 05's, plain JAX -----------------------------------------------------


@jax.custom_jvp
def softplus(z: jax.Array) -> jax.Array:
    """log(1 + e^z), with its derivative sigmoid(z) attached: cheaper on shares (tutorial 05)."""
    return jnp.logaddexp(z, 0.0)


@softplus.defjvp
def _softplus_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> Any:
    (z,), (dz,) = primals, tangents
    return softplus(z), jax.nn.sigmoid(z) * dz


def loss(params: Params, x_alice: jax.Array, x_bob: jax.Array, y: jax.Array) -> jax.Array:
    z = jnp.concatenate([x_alice, x_bob], axis=1) @ params["w"] + params["b"]
    return jnp.mean(softplus(z) - y * z)


def train_step(params: Params, x_alice: jax.Array, x_bob: jax.Array, y: jax.Array) -> Params:
    grads = jax.grad(loss)(params, x_alice, x_bob, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def accuracy(params: Params, x: Array, y: Array) -> float:
    z = x @ np.asarray(params["w"]) + np.asarray(params["b"])
    return float(np.mean((z > 0) == (y > 0.5)))


# -- the two programs ------------------------------------------------------------------------


def standardized(columns: list[str]) -> str:
    """SQL: the id, and each column standardized over the table's rows. SQL promises no row
    order without ORDER BY, so every party sorts its rows by the ids they all share."""
    scaled = [f"({c} - AVG({c}) OVER ()) / STDDEV_POP({c}) OVER () AS {c}" for c in columns]
    return f"SELECT id, {', '.join(scaled)} FROM t ORDER BY id"


@mp.function
def align() -> tuple[Any, ...]:
    """Read, intersect, standardize; the tables stay at their parties. Also returns the
    number of shared customers, at Carol."""
    customers = [mp.read(party, "customers") for party in FILES]
    a, b, c = mp.psi(*customers, key="id")
    a = mp.sql("alice", standardized(FEATURES_A), t=a)
    b = mp.sql("bob", standardized(FEATURES_B), t=b)
    c = mp.sql("carol", "SELECT id, label FROM t ORDER BY id", t=c)
    return a, b, c, mp.num_rows(c)


@mp.function
def train(a: mp.MPObject, b: mp.MPObject, c: mp.MPObject, rows: int) -> Params:
    """Arrays of `rows` rows from the tables, sealed; EPOCHS gradient steps on the shares;
    the weights revealed to Alice and Bob, who each write them as `model.csv`."""
    x_alice = mp.to_tensor(a, FEATURES_A, rows=rows)
    x_bob = mp.to_tensor(b, FEATURES_B, rows=rows)
    y = mp.to_tensor(c, "label", rows=rows)
    zeros = {"w": np.zeros(16, np.float32), "b": np.zeros(1, np.float32)}
    params = {k: mp.constant(v, "alice") for k, v in zeros.items()}
    params, x_alice, x_bob, y = mp.mpc.seal((params, x_alice, x_bob, y))

    def epoch(i: mp.MPObject, params: Params) -> Params:
        return mp.mpc.run(train_step, params, x_alice, x_bob, y)  # sealed in, sealed out

    model = mp.mpc.reveal(mp.fori_loop(0, EPOCHS, epoch, params), to=["alice", "bob"])
    row = mp.run_jax(lambda m: jnp.concatenate([m["w"], m["b"]])[None], model)
    table = mp.from_tensor(row, MODEL_COLUMNS)  # at Alice and Bob
    for party in ("alice", "bob"):
        mp.write(party, "model", table, format="csv")
    return model


def run_pipeline(cluster: mp.Cluster) -> Params:
    """Both programs on `cluster`, whose cluster file is `write_data`'s; returns the model
    as revealed to Alice."""
    start = time.perf_counter()
    a, b, c, rows = cluster.evaluate(align)
    shared = int(cluster.fetch(rows, party="carol"))  # the one number the driver is told
    print(f"== 1. intersected and standardized in {time.perf_counter() - start:.1f} s")
    for party, table in zip(FILES, (a, b, c), strict=True):
        print(f"  {party:5} holds {table.type}")
    print(f"  revealed: {shared} customers are shared by all three")

    start = time.perf_counter()
    model = cluster.evaluate(train, a, b, c, rows=shared)
    print(f"\n== 2. sealed, trained and revealed in {time.perf_counter() - start:.1f} s")
    return {k: cluster.fetch(v, party="alice") for k, v in model.items()}


# -- the yardstick ---------------------------------------------------------------------------


def plaintext_join(spec: ClusterSpec) -> tuple[Array, Array]:
    """The standardized features and the labels of the customers in all three files, joined
    by id directly: what one trusted party holding every file would compute."""
    tables = [pcsv.read_csv(party.data[0].path) for party in spec.parties]
    shared = pa.array(sorted(set.intersection(*(set(t["id"].to_pylist()) for t in tables))))
    a, b, c = (t.take(pc.index_in(shared, value_set=t["id"])) for t in tables)
    x = np.stack([a[n].to_numpy() for n in FEATURES_A] + [b[n].to_numpy() for n in FEATURES_B], 1)
    return (x - x.mean(axis=0)) / x.std(axis=0), c["label"].to_numpy().astype(np.float32)


def judge(spec: ClusterSpec, model: Params) -> tuple[float, float]:
    """Train the same epochs in plaintext on the true join, compare the secure model with it
    and with the files Alice and Bob wrote; return both accuracies (secure, plaintext)."""
    x, y = plaintext_join(spec)
    step = jax.jit(train_step)
    plain = {"w": np.zeros(16, np.float32), "b": np.zeros(1, np.float32)}
    for _ in range(EPOCHS):
        plain = step(plain, x[:, :8], x[:, 8:], y)
    secure_accuracy, plain_accuracy = accuracy(model, x, y), accuracy(plain, x, y)
    print(f"\n== 3. the yardstick: {EPOCHS} epochs in plaintext on the true join ({len(y)} rows)")
    print(
        f"  accuracy on the joined customers: secure {secure_accuracy:.3f}, "
        f"plaintext {plain_accuracy:.3f}"
    )
    assert abs(secure_accuracy - plain_accuracy) <= TOLERANCE, "secure training fell behind"
    weights = np.concatenate([model["w"], model["b"]])
    for party in ("alice", "bob"):
        outputs = spec.party(party).outputs
        assert outputs is not None, f"the cluster file gives {party} an outputs folder"
        saved = pcsv.read_csv(outputs.path / "model.csv")
        assert saved.column_names == MODEL_COLUMNS, saved.column_names
        assert np.allclose([saved[n][0].as_py() for n in MODEL_COLUMNS], weights)
        print(
            f"  {party} wrote {saved.num_rows} row of {saved.num_columns} weights to "
            f"{outputs.path / 'model.csv'}"
        )
    return secure_accuracy, plain_accuracy


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="mpplug-tutorial-07-") as folder:
        config = write_data(Path(folder))
        spec = ClusterSpec.from_yaml(config)
        for party in spec.parties:
            print(f"{party.name} holds {party.data[0].path.name} as its dataset 'customers'")
        with mp.Simulator(config) as sim:
            print()
            model = run_pipeline(sim)
        judge(spec, model)


if __name__ == "__main__":
    main()
