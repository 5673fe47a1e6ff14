"""Tutorial 4: the millionaires' problem, solved securely with a helper party.

Alice and Bob want to know which of them is richer without telling each other (or anyone) their
wealth. With a third party, Carol, they can: `mp.mpc.seal` splits each value into three
random-looking shares and gives every party two of them (replicated secret sharing, the ABY3
protocol), `mp.mpc.run` evaluates `a < b` on the shares, and `mp.mpc.reveal` opens only the
answer, to Alice and Bob.

This holds against one curious party that follows the program (semi-honest, honest majority):
alone, each party sees only random-looking numbers. Two parties that pool what they hold can
reconstruct everything; section 3 shows why. See docs/mpc.md for the protocol.
"""

from __future__ import annotations

import time

import numpy as np

import mpplug as mp
from mpplug.config import ClusterSpec

# Ranks follow the cluster's order: alice is 0, bob 1, carol 2; names work wherever ranks do.
PARTIES = ["alice", "bob", "carol"]


@mp.function
def millionaire(alice_wealth: mp.MPObject, bob_wealth: mp.MPObject) -> mp.MPObject:
    a, b = mp.mpc.seal((alice_wealth, bob_wealth))  # each owner deals shares to all three
    bob_is_richer = mp.mpc.run(lambda x, y: x < y, a, b)  # a sealed bool: nobody knows it yet
    return mp.mpc.reveal(bob_is_richer, to=["alice", "bob"])


@mp.function
def sealed_wealth(alice_wealth: mp.MPObject, bob_wealth: mp.MPObject) -> tuple[mp.mpc.Sealed, ...]:
    """Only the sealing step, returned as it is, so that we can look at each party's shares."""
    return mp.mpc.seal((alice_wealth, bob_wealth))


def main() -> None:
    spec = ClusterSpec.local(PARTIES)
    with mp.Simulator(spec) as sim:
        alice = sim.put("alice", np.int64(3_000_000))
        bob = sim.put("bob", np.int64(5_000_000))

        # 1. The program. Read it from the top: each owner draws a seed (mpplug.random) and
        #    splits its value (split), sending one pair of shares to each other party
        #    (shuffle); the parties draw fresh PRF keys and pass one to a neighbour (context);
        #    then come the rounds of the comparison, one fused PFunction per round with one
        #    message between rounds (the sign of a - b by a carry-lookahead adder on shares);
        #    last, the reveal sends Alice and Bob the one share each is missing (combine).
        program = sim.compile(millionaire, alice, bob)
        print("== 1. the program every party receives")
        print(program.ir())
        kinds = [op.kind.name for op in program.graph.ops]
        print(f"{len(kinds)} ops: {kinds.count('CALL')} CALLs, {kinds.count('SHUFFLE')} SHUFFLEs")

        # 2. Run it. The answer exists only at Alice and Bob; Carol holds nothing.
        print("\n== 2. the answer")
        start = time.perf_counter()
        answer = sim.evaluate(millionaire, alice, bob)
        first = time.perf_counter() - start
        print(f"held by: {[sim.parties[r] for r in sorted(answer.parties)]}")
        for name, value in zip(sim.parties, sim.fetch(answer), strict=True):
            print(f"  {name:5} holds {'nothing' if value is None else bool(value)}")
        print(f"Is Bob richer than Alice? {bool(sim.fetch(answer, party='alice'))}")
        start = time.perf_counter()
        sim.fetch(sim.evaluate(millionaire, alice, bob), party="alice")
        again = time.perf_counter() - start
        print(f"first evaluation {first:.2f} s (XLA compiles each round once), then {again:.3f} s")

        # 3. What a party holds. Returned from a program, sealed values stay sealed: a Sealed
        #    holding a handle to every party's shares. The wealth w is x0 + x1 + x2 (mod 2^64)
        #    for random x0, x1; the party of rank i holds (x_i, x_i+1).
        print("\n== 3. what each party holds of Bob's 5,000,000")
        _, bob_sealed = sim.evaluate(sealed_wealth, alice, bob)
        print(bob_sealed)
        held = dict(zip(sim.parties, sim.fetch(bob_sealed.shares), strict=True))
        for i, (name, pair) in enumerate(held.items()):
            print(f"  {name:5} (x{i}, x{(i + 1) % 3}) = ({pair[0]:#018x}, {pair[1]:#018x})")
        print("Each pair alone is two uniformly random words: Alice and Carol learn nothing.")
        pooled = np.array([*held["alice"], held["carol"][0]], np.uint64)  # x0, x1 and x2
        total = int(pooled.sum(dtype=np.uint64).astype(np.int64))
        print(
            f"Alice and Carol together: x0 + x1 + x2 = {total:,} (why one honest party in "
            f"three is needed)"
        )

        # 4. Fresh randomness on every evaluation: the same input gives new shares (and new
        #    PRF keys inside the comparison), so runs cannot be linked by their shares.
        print("\n== 4. new shares every time")
        _, bob_again = sim.evaluate(sealed_wealth, alice, bob)
        carol_now = sim.fetch(bob_again.shares, party="carol")
        print(f"  carol held {held['carol'][0]:#018x}, now {carol_now[0]:#018x}")
        for a, b in [(3_000_000, 5_000_000), (7_000_000, 5_000_000), (5_000_000, 5_000_000)]:
            richer = sim.evaluate(
                millionaire, sim.put("alice", np.int64(a)), sim.put("bob", np.int64(b))
            )
            print(f"  alice {a:>9,}  bob {b:>9,}  Bob richer: {bool(sim.fetch(richer, 'bob'))}")


if __name__ == "__main__":
    main()
