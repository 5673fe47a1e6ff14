"""Quickstart: Yao's millionaires' problem on two simulated parties.

Alice (party 0) and Bob (party 1) each hold their wealth privately. The program moves Bob's
value to Alice only inside the program and computes at Alice who is richer; the caller fetches
just the answer. (This shows placement and data movement; it is not a secure protocol.)
"""

from __future__ import annotations

import numpy as np

import mpplug as mp


@mp.function
def millionaire(alice_wealth: mp.MPObject, bob_wealth: mp.MPObject) -> mp.MPObject:
    bob_at_alice = mp.p2p("bob", "alice", bob_wealth)
    return mp.run_jax_at("alice", lambda a, b: a < b, alice_wealth, bob_at_alice)


def main() -> None:
    from mpplug.config import ClusterSpec

    spec = ClusterSpec.local(["alice", "bob"])
    with mp.Simulator(spec) as sim:
        alice = sim.put("alice", np.int64(3_000_000))
        bob = sim.put("bob", np.int64(5_000_000))
        bob_is_richer = sim.evaluate(millionaire, alice, bob)
        print(sim.compile(millionaire, alice, bob).ir())
        answer = sim.fetch(bob_is_richer, party="alice")
        print(f"Is Bob richer than Alice? {bool(answer)}")


if __name__ == "__main__":
    main()
