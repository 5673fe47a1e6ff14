"""The quickstart: Yao's millionaires' problem on two simulated parties.

Run it with `mpplug demo` or `python tutorials/00_quickstart.py`; both run this module.
"""

from __future__ import annotations

import numpy as np

import mpplug as mp


@mp.function
def millionaire(alice_wealth: mp.MPObject, bob_wealth: mp.MPObject) -> mp.MPObject:
    """Alice (party 0) and Bob (party 1) hold their wealth privately. Bob's value moves to
    Alice only inside the program, Alice compares, and only the answer can be fetched.
    (This shows placement and data movement; it is not a cryptographic protocol.)"""
    bob_at_alice = mp.p2p("bob", "alice", bob_wealth)
    return mp.run_jax_at("alice", lambda a, b: a < b, alice_wealth, bob_at_alice)


def main() -> None:
    from mpplug.config import ClusterSpec

    spec = ClusterSpec.local(["alice", "bob"])
    with mp.Simulator(spec) as sim:
        alice = sim.put("alice", np.int64(3_000_000))
        bob = sim.put("bob", np.int64(5_000_000))
        print("The program every party receives:")
        print(sim.compile(millionaire, alice, bob).ir())
        bob_is_richer = sim.evaluate(millionaire, alice, bob)
        print(f"Held by: {sim.parties[min(bob_is_richer.parties)]}")
        answer = sim.fetch(bob_is_richer, party="alice")
        print(f"Is Bob richer than Alice? {bool(answer)}")


if __name__ == "__main__":
    main()
