"""One program, two clusters: the same `@mp.function` on the thread Simulator and on real party
processes reached over gRPC by a Driver, with identical results.

The parties here run on this machine at free loopback ports; on real hosts you would write the
same kind of cluster file and run `mpplug serve --config cluster.yaml --party NAME` on each
(see docs/deployment.md). The Simulator takes the very same cluster spec.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import yaml

import mpplug as mp
from mpplug.config import ClusterSpec
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties


@mp.function
def salary_survey(a: mp.MPObject, b: mp.MPObject, c: mp.MPObject) -> dict[str, mp.MPObject]:
    """Three employers each hold four salaries. Each sums its own, Carol receives the other
    two sums and computes the mean, and everyone gets only that mean back."""
    sums = [mp.run_jax(jnp.sum, x) for x in (a, b, c)]
    moved = [mp.p2p(src, "carol", s) for src, s in zip(("alice", "bob"), sums[:2], strict=True)]
    mean = mp.run_jax_at("carol", lambda *s: sum(s) / 12, *moved, sums[2])
    return {"mean": mp.bcast("carol", mean), "rank": mp.prank()}


def run(cluster: mp.Cluster) -> dict[str, list[Any]]:
    """Put each party's private input, run the program, fetch what every party holds."""
    rng = np.random.default_rng(7)
    inputs = [
        cluster.put(name, rng.integers(30_000, 90_000, size=4).astype(np.float64))
        for name in ("alice", "bob", "carol")
    ]
    out = cluster.evaluate(salary_survey, *inputs)
    return {key: cluster.fetch(value) for key, value in out.items()}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="mpplug-tutorial-") as tmp:
        # A cluster file: three parties on free loopback ports (rank = position in the list).
        spec = ClusterSpec.local(["alice", "bob", "carol"])
        config = Path(tmp) / "cluster.yaml"
        config.write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
        print(f"cluster file:\n{config.read_text()}")

        # 1. The Simulator: every party a thread of this process.
        with mp.Simulator(ClusterSpec.from_yaml(config)) as sim:
            simulated = run(sim)
        print("simulator:", _show(simulated))

        # 2. Real parties: one `python -m mpplug.remote.server` process each (what
        #    `mpplug up --config cluster.yaml` does), stopped when the block ends.
        with LocalParties(config, log_dir=Path(tmp) / "logs") as parties:
            parties.start()
            parties.wait_ready(timeout=120)
            with Driver(config) as driver:
                real = run(driver)
        print("driver:   ", _show(real))

    same = all(
        all(np.array_equal(x, y) for x, y in zip(simulated[k], real[k], strict=True))
        for k in simulated
    )
    assert same, "the two clusters disagree"
    print("identical results on the Simulator and on real party processes:", same)


def _show(results: dict[str, list[Any]]) -> str:
    return ", ".join(f"{key}={[v.tolist() for v in values]}" for key, values in results.items())


if __name__ == "__main__":
    main()
