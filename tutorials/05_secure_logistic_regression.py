"""Tutorial 5: logistic regression trained on data that no single party may see.

Alice and Bob hold different features of the same 3,000 people (vertically split data: 8
columns each) and Carol holds their labels. Together they train a logistic regression by
full-batch gradient descent under `mp.mpc`: the data are sealed once, every epoch runs
`jax.grad` of the loss on shares, the weights stay sealed between epochs, and only the final
weights are revealed, to Alice and Bob. The same training in plaintext gives the yardstick:
the secure model's test accuracy must be within one point of it.

What to notice: the training step is plain JAX (`jax.grad`, `@`, `jax.nn.sigmoid`), one
program per epoch is compiled once and then reused, and sealed values returned by one
evaluation are passed into the next without ever being opened.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mpplug as mp
from mpplug.config import ClusterSpec

N_TRAIN, N_TEST, N_FEATURES = 2_000, 1_000, 16
SPLIT = 8  # alice holds features 0..7, bob 8..15
EPOCHS = 15
LEARNING_RATE = 1.0
SEED = 2024
TOLERANCE = 0.01  # the secure model's test accuracy may differ by one point at most

Params = dict[str, Any]


def synthetic_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardized features and labels drawn from a logistic model (fixed seed)."""
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(N_TRAIN + N_TEST, N_FEATURES))
    true_w = rng.normal(size=N_FEATURES)
    p = 1.0 / (1.0 + np.exp(-(x @ true_w + 0.5)))
    y = (rng.random(len(x)) < p).astype(np.float64)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


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
def seal_inputs(
    x_alice: mp.MPObject, x_bob: mp.MPObject, y: mp.MPObject, params: Params
) -> tuple[Any, ...]:
    """Each owner deals shares of its own data; nothing is opened."""
    return mp.mpc.seal((x_alice, x_bob, y, params))


@mp.function
def epoch(params: Params, x_alice: mp.mpc.Sealed, x_bob: mp.mpc.Sealed, y: mp.mpc.Sealed) -> Params:
    """One gradient step on shares; the new weights come back sealed."""
    return mp.mpc.run(train_step, params, x_alice, x_bob, y)


@mp.function
def reveal_model(params: Params) -> Params:
    return mp.mpc.reveal(params, to=["alice", "bob"])


def main() -> None:
    x_train, y_train, x_test, y_test = synthetic_data()
    initial = {"w": np.zeros(N_FEATURES), "b": np.zeros(1)}

    # 1. The yardstick: the same step, in plaintext, on one machine.
    step = jax.jit(train_step)
    plain = dict(initial)
    for _ in range(EPOCHS):
        plain = step(plain, x_train[:, :SPLIT], x_train[:, SPLIT:], y_train)
    plain_accuracy = accuracy(plain, x_test, y_test)
    print(f"== 1. plaintext: {EPOCHS} epochs, test accuracy {plain_accuracy:.3f}")

    with mp.Simulator(ClusterSpec.local(["alice", "bob", "carol"])) as sim:
        # 2. Each party puts only what it owns; the initial weights come from alice.
        x_alice = sim.put("alice", x_train[:, :SPLIT])
        x_bob = sim.put("bob", x_train[:, SPLIT:])
        y = sim.put("carol", y_train)
        start = time.perf_counter()
        *data, params = sim.evaluate(
            seal_inputs, x_alice, x_bob, y, {k: sim.put("alice", v) for k, v in initial.items()}
        )
        print(f"\n== 2. sealed in {time.perf_counter() - start:.1f} s:")
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

        # 4. Reveal the model to alice and bob only, and compare.
        model = sim.evaluate(reveal_model, params)
        print(f"\n== 4. carol receives: {sim.fetch(model['w'])[2]}")
        secure = {k: sim.fetch(v, party="alice") for k, v in model.items()}

    secure_accuracy = accuracy(secure, x_test, y_test)
    gap = np.abs(secure["w"] - np.asarray(plain["w"])).max()
    print(
        f"  secure test accuracy {secure_accuracy:.3f}, plaintext {plain_accuracy:.3f}; "
        f"largest weight difference {gap:.1e}"
    )
    assert abs(secure_accuracy - plain_accuracy) <= TOLERANCE, "secure training fell behind"
    print(f"  within {TOLERANCE:.0%} of plaintext training: yes")


if __name__ == "__main__":
    main()
