"""The quickstart: Yao's millionaires' problem, solved securely by three simulated parties.

Alice and Bob each hold their wealth. The values are secret-shared among Alice, Bob and a
helper, Carol; the comparison runs on the shares (`mp.mpc`, the ABY3 protocol), and only the
answer is opened, to Alice and Bob. Neither learns the other's wealth and Carol learns nothing.

Run it with `mpplug demo` or `python tutorials/00_quickstart.py`; both run this module.
`tutorials/04_secure_millionaire.py` walks through the same program step by step.
"""

from __future__ import annotations

import numpy as np

import mpplug as mp


@mp.function
def millionaire(alice_wealth: mp.MPObject, bob_wealth: mp.MPObject) -> mp.MPObject:
    """Is Bob richer than Alice? Each wealth leaves its owner only as random-looking shares,
    one pair per party; `a < b` is evaluated on the shares, and only its answer is revealed."""
    a, b = mp.mpc.seal((alice_wealth, bob_wealth))  # shares among alice, bob and carol
    bob_is_richer = mp.mpc.run(lambda x, y: x < y, a, b)  # computed on shares: still sealed
    return mp.mpc.reveal(bob_is_richer, to=["alice", "bob"])  # opened to these two only


def main() -> None:
    from mpplug.config import ClusterSpec

    spec = ClusterSpec.local(["alice", "bob", "carol"])
    with mp.Simulator(spec) as sim:
        alice = sim.put("alice", np.int64(3_000_000))  # held by alice only
        bob = sim.put("bob", np.int64(5_000_000))  # held by bob only
        print("The program every party receives:")
        print(sim.compile(millionaire, alice, bob).ir())
        answer = sim.evaluate(millionaire, alice, bob)
        learned = dict(zip(sim.parties, sim.fetch(answer), strict=True))
        print(f"Is Bob richer than Alice? {bool(learned['alice'])}")
        for name, value in learned.items():
            print(f"  {name:5} learned: {'nothing' if value is None else bool(value)}")


if __name__ == "__main__":
    main()
