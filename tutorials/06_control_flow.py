"""Tutorial 6: branches and loops that run inside the parties.

`mp.cond`, `mp.while_loop` and `mp.fori_loop` trace their functions once into regions of one
COND or WHILE op. Every party taking part runs the branch or the loop itself: a loop of a
thousand steps is one op in the program, needs no message to or from the driver per step,
and may stop on a condition computed from data.

1. A branch chosen by one party's flag, where the branches move different values.
2. A loop whose step count depends on data: training under `mp.mpc` until the revealed loss
   stops improving, the weights sealed from the first step to the last.
3. `mp.fori_loop` with a p2p every step, and what its program looks like.

What to notice: the predicate of a branch or loop must be held, with one value, by every party
taking part (broadcast it, or reveal it), and a loop's carried values keep their types and
placements from one step to the next.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import mpplug as mp

# -- 1. a branch -----------------------------------------------------------------------------


@mp.function
def audit_or_skip(ledger, sample, audit_wanted):
    """Carol (party 2) gets Alice's ledger total if Bob asks for an audit, else Bob's sample."""
    ask = mp.bcast(1, audit_wanted)  # every party of either branch must hold the predicate

    def audit(ledger, sample):
        return mp.p2p(0, 2, mp.run_jax(jnp.sum, ledger))

    def skip(ledger, sample):
        return mp.p2p(1, 2, mp.run_jax(jnp.sum, sample))

    return mp.cond(ask, audit, skip, ledger, sample)


# -- 2. a loop that stops on a revealed value ------------------------------------------------

MAX_STEPS, MIN_GAIN = 60, 1e-3


@mp.function
def fit_until_flat(features, targets):
    """Least squares by gradient descent on sealed data, until the loss gains < MIN_GAIN."""
    x, y = mp.mpc.seal(features), mp.mpc.seal(targets)
    w = mp.mpc.run(lambda x: jnp.zeros(x.shape[1]), x)

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def improving(state):
        _, last, previous, steps = state
        return mp.run_jax(
            lambda a, b, s: (b - a > MIN_GAIN) & (s < MAX_STEPS), last, previous, steps
        )

    def step(state):
        w, last, _, steps = state
        w = mp.mpc.run(lambda w, x, y: w - 0.5 * (2 / len(y)) * x.T @ (x @ w - y), w, x, y)
        now = mp.mpc.reveal(mp.mpc.run(loss, w, x, y))  # only the loss is opened
        return w, now, last, mp.run_jax(lambda s: s + 1, steps)

    start = (w, mp.constant(np.float32(1e6)), mp.constant(np.float32(2e6)), mp.constant(0))
    w, last, _, steps = mp.while_loop(improving, step, start)
    return mp.mpc.reveal(w, to=[0, 1]), last, steps


# -- 3. a counted loop -----------------------------------------------------------------------


@mp.function
def relay(x):
    """x travels from Alice to Bob and back a thousand times; Bob adds the step number."""

    def step(i, x):
        at_bob = mp.p2p(0, 1, x)
        return mp.p2p(1, 0, mp.run_jax(lambda v, i: v + i, at_bob, i))

    return mp.fori_loop(0, 1000, step, x)


def main() -> None:
    with mp.Simulator(3) as sim:
        ledger = sim.put(0, np.array([120, 80, 45], np.int32))
        sample = sim.put(1, np.array([7, 9], np.int32))
        for wanted in (True, False):
            total = sim.evaluate(audit_or_skip, ledger, sample, sim.put(1, np.bool_(wanted)))
            print(f"audit wanted: {wanted!s:5}  Carol gets {sim.fetch(total, party=2)}")

        rng = np.random.default_rng(6)
        features = rng.normal(size=(200, 3)).astype(np.float32)
        true_w = np.array([1.5, -2.0, 0.5], np.float32)
        targets = (features @ true_w + 0.1 * rng.normal(size=200)).astype(np.float32)
        w, last, steps = sim.evaluate(fit_until_flat, sim.put(0, features), sim.put(1, targets))
        print(
            f"\nsecure least squares stopped after {int(sim.fetch(steps, party=2))} steps, "
            f"loss {float(sim.fetch(last, party=2)):.4f}"
        )
        print(f"weights revealed to Alice: {np.round(sim.fetch(w, party=0), 2)} (true {true_w})")

        out = sim.evaluate(relay, sim.put(0, np.int32(0)))
        print(f"\nafter 1000 round trips Alice holds {sim.fetch(out, party=0)}")
        print(sim.compile(relay, sim.put(0, np.int32(0))).ir())


if __name__ == "__main__":
    main()
