"""Tutorial 5: logistic regression trained on data that no single party may see.

Alice and Bob hold different features of the same 2,000 people (vertically split data: 8
columns each) and Carol holds their labels. Each keeps its part as a dataset declared in the
cluster file tutorials/data/cluster.yaml (`features` at Alice and at Bob, `labels` at Carol;
tutorials/make_data.py writes the files). Together they train a logistic regression by
full-batch gradient descent under `mp.mpc`: each party reads its own dataset with `mp.read`
and seals it where it lies, every epoch runs `jax.grad` of the loss on shares, the weights
stay sealed between epochs, and only the final weights are revealed, to Alice and Bob; Alice
also saves them to her outputs directory with `mp.write`. The same training in plaintext
gives the yardstick: the secure model's test accuracy on 1,000 held-out people must be within
one point of it.

What to notice: the driver (this script) never holds the data. It names datasets, the parties
tell it their dtypes and shapes while the program is traced, and the arrays go from each
party's disk straight into its shares; even the size of the initial weights comes from those
shapes. (Only the yardstick opens the files directly: it stands for what one trusted party
holding everything would compute.) The training step is plain JAX (`jax.grad`, `@`,
`jax.nn.sigmoid`), one program per epoch is compiled once and then reused, and sealed values
returned by one evaluation are passed into the next without ever being opened. It all runs
on the Simulator, which takes the cluster file; `mp.Driver` would run the same programs on
real parties started from that file (tutorial 03 shows how).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from make_data import HOLDOUT_FILE, ensure_data

import mpplug as mp
from mpplug.config import ClusterSpec

EPOCHS = 15
LEARNING_RATE = 1.0
TOLERANCE = 0.01  # the secure model's test accuracy may differ by one point at most

Params = dict[str, Any]
Array = np.ndarray[Any, Any]


def plaintext_data(spec: ClusterSpec) -> tuple[Array, Array, Array, Array, Array]:
    """The yardstick's view: the files the cluster file names, opened directly, and the
    held-out people. Alice's and Bob's training features, Carol's labels, test x and y."""
    files = {(party.name, d.name): d.path for party in spec.parties for d in party.data}
    x_alice = np.load(files["alice", "features"])
    x_bob = np.load(files["bob", "features"])
    y = np.load(files["carol", "labels"])
    with np.load(HOLDOUT_FILE) as holdout:
        return x_alice, x_bob, y, holdout["x"], holdout["y"]


# -- the model: plain JAX, used as it is in plaintext and under MPC ---------------------------


@jax.custom_jvp
def softplus(z: jax.Array) -> jax.Array:
    """log(1 + e^z), with its textbook derivative sigmoid(z) attached.

    `jax.nn.softplus` would do in plaintext, but its derivative as JAX derives it goes
    through exp, log1p and infinity checks; on shares that gives a training step about three
    times as many rounds as one secure sigmoid does (docs/mpc.md lists each rule's cost)."""
    return jnp.logaddexp(z, 0.0)


@softplus.defjvp
def _softplus_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> Any:
    (z,), (dz,) = primals, tangents
    return softplus(z), jax.nn.sigmoid(z) * dz


def logits(params: Params, x_alice: jax.Array, x_bob: jax.Array) -> jax.Array:
    x = jnp.concatenate([x_alice, x_bob], axis=1)
    return x @ params["w"] + params["b"]


def loss(params: Params, x_alice: jax.Array, x_bob: jax.Array, y: jax.Array) -> jax.Array:
    """Binary cross entropy of the logits z: mean(softplus(z) - y z)."""
    z = logits(params, x_alice, x_bob)
    return jnp.mean(softplus(z) - y * z)


def train_step(params: Params, x_alice: jax.Array, x_bob: jax.Array, y: jax.Array) -> Params:
    grads = jax.grad(loss)(params, x_alice, x_bob, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def accuracy(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    z = x @ np.asarray(params["w"]) + np.asarray(params["b"])
    return float(np.mean((z > 0) == (y > 0.5)))


# -- the programs ----------------------------------------------------------------------------


@mp.function
def seal_inputs() -> tuple[Any, ...]:
    """Each owner reads its own dataset and deals shares of it; nothing is opened. The
    initial weights are zeros at Alice, as many as the parties' shapes say there are features."""
    x_alice = mp.read("alice", "features")
    x_bob = mp.read("bob", "features")
    y = mp.read("carol", "labels")
    n_features = x_alice.shape[1] + x_bob.shape[1]
    params = {
        "w": mp.constant(np.zeros(n_features), "alice"),
        "b": mp.constant(np.zeros(1), "alice"),
    }
    return mp.mpc.seal((x_alice, x_bob, y, params))


@mp.function
def epoch(params: Params, x_alice: mp.mpc.Sealed, x_bob: mp.mpc.Sealed, y: mp.mpc.Sealed) -> Params:
    """One gradient step on shares; the new weights come back sealed."""
    return mp.mpc.run(train_step, params, x_alice, x_bob, y)


@mp.function
def reveal_model(params: Params) -> Params:
    """Open the weights to Alice and Bob only; Alice also saves them to her outputs."""
    model = mp.mpc.reveal(params, to=["alice", "bob"])
    for name, value in model.items():
        mp.write("alice", f"model_{name}", value)
    return model


def main() -> None:
    cluster_file = ensure_data()  # writes the data files on the first run
    spec = ClusterSpec.from_yaml(cluster_file)
    x_alice, x_bob, y, x_test, y_test = plaintext_data(spec)

    # 1. The yardstick: the same step, in plaintext, on one machine that sees everything.
    step = jax.jit(train_step)
    plain = {"w": np.zeros(x_test.shape[1]), "b": np.zeros(1)}
    for _ in range(EPOCHS):
        plain = step(plain, x_alice, x_bob, y)
    plain_accuracy = accuracy(plain, x_test, y_test)
    print(f"== 1. plaintext: {EPOCHS} epochs, test accuracy {plain_accuracy:.3f}")

    with mp.Simulator(cluster_file) as sim:
        # 2. Each party reads and seals only what it owns; the driver sends no data at all.
        start = time.perf_counter()
        *data, params = sim.evaluate(seal_inputs)
        print(f"\n== 2. read and sealed at the parties in {time.perf_counter() - start:.1f} s:")
        for name, value in zip(
            ["alice's features", "bob's features", "carol's labels"], data, strict=True
        ):
            print(f"  {name:16} {value}")
        print(f"  {'weights':16} {params}")

        # 3. Train. The epoch program is compiled once; each evaluation draws fresh keys.
        program = sim.compile(epoch, params, *data)
        kinds = [op.kind.name for op in program.graph.ops]
        print(f"\n== 3. one epoch is {len(kinds)} ops, {kinds.count('SHUFFLE')} of them SHUFFLEs")
        times = []
        for _ in range(EPOCHS):
            start = time.perf_counter()
            params = sim.evaluate(epoch, params, *data)  # sealed in, sealed out
            times.append(time.perf_counter() - start)
        print(
            f"  first epoch {times[0]:.1f} s (XLA compiles each round once), "
            f"then {np.median(times[1:]) * 1e3:.0f} ms per epoch"
        )
        print(f"  the weights are still sealed: {params['w']}")

        # 4. Reveal the model to alice and bob only (alice keeps a copy on disk), and compare.
        model = sim.evaluate(reveal_model, params)
        print(f"\n== 4. carol receives: {sim.fetch(model['w'])[2]}")
        secure = {k: sim.fetch(v, party="alice") for k, v in model.items()}

    print(f"  alice saved {saved_model(spec, secure)}")
    secure_accuracy = accuracy(secure, x_test, y_test)
    gap = np.abs(secure["w"] - np.asarray(plain["w"])).max()
    print(
        f"  secure test accuracy {secure_accuracy:.3f}, plaintext {plain_accuracy:.3f}; "
        f"largest weight difference {gap:.1e}"
    )
    assert abs(secure_accuracy - plain_accuracy) <= TOLERANCE, "secure training fell behind"
    print(f"  within {TOLERANCE:.0%} of plaintext training: yes")


def saved_model(spec: ClusterSpec, model: Params) -> str:
    """Check that alice's outputs hold the revealed model; name the files."""
    outputs = spec.party("alice").outputs
    assert outputs is not None, "the cluster file gives alice an outputs directory"
    files = {name: outputs.path / f"model_{name}.npy" for name in model}
    for name, path in files.items():
        assert np.array_equal(np.load(path), model[name]), f"{path} holds another model"
    return f"{', '.join(path.name for path in files.values())} in {outputs.path}"


if __name__ == "__main__":
    main()
