"""Programs: placing JAX work on parties, moving values between them, and reading the IR.

Three parties each hold a private vector; together they compute the mean of all three
without anyone but party 0 seeing the others' inputs, then share only the result.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import mpplug as mp


@mp.function
def private_mean(a: mp.MPObject, b: mp.MPObject, c: mp.MPObject) -> dict[str, mp.MPObject]:
    # Each party first works on its own data, where it lives.
    local = [mp.run_jax(lambda v: v.astype(jnp.float32) * 2.0, x) for x in (a, b, c)]
    # Values move only when the program says so: gather everything at party 0...
    at_0 = [mp.p2p(src, 0, x) for src, x in enumerate(local)]
    mean = mp.run_jax_at(0, lambda *vs: jnp.mean(jnp.stack(vs), axis=0) / 2.0, *at_0)
    # ...and broadcast just the result.
    shared = mp.bcast(0, mean)
    # Every party knows its own rank and draws private randomness.
    noise = mp.prand((2,))
    return {"mean": shared, "rank": mp.prank(), "noise": noise}


def main() -> None:
    with mp.Simulator(3) as sim:
        inputs = [sim.put(i, np.arange(4, dtype=np.int32) * (i + 1)) for i in range(3)]

        program = sim.compile(private_mean, *inputs)
        print("The program as every party receives it:")
        print(program.ir())
        print(f"{len(program.to_bytes())} bytes, digest {program.digest[:16]}...\n")

        out = sim.evaluate(private_mean, *inputs)
        print("held by:", {k: sorted(v.parties) for k, v in out.items()})
        for party, value in enumerate(sim.fetch(out["mean"])):
            print(f"party {party} mean: {value}")
        print("ranks:", [int(r) for r in sim.fetch(out["rank"])])
        print("private noise differs per party:", sim.fetch(out["noise"]))

        # Handles stay at the parties: feed an output straight into another program.
        doubled = sim.evaluate(mp.function(lambda m: mp.run_jax(lambda v: v * 2, m)), out["mean"])
        print("doubled at party 2:", sim.fetch(doubled, party=2))


if __name__ == "__main__":
    main()
