"""One program, two clusters: the same `@mp.function` on the thread Simulator and on real party
processes reached over gRPC by a Driver, both from the same cluster file, with identical results.

The cluster file is tutorials/data/cluster.yaml (tutorials/make_data.py writes the files it
names). Besides each party's endpoint it declares the party's private datasets (`data:`) and
where programs may write its results (`outputs:`). The program names datasets, never paths:
`mp.read("bob", "salaries")` loads Bob's file at Bob, whatever its format (a .npy at Alice, an
array of a .npz at Bob, a .csv at Carol), and `mp.write("carol", "mean", x)` saves a value
Carol holds as <carol's outputs>/mean.npy, on Carol's side.

What to notice:
- the driver (this script) never holds a salary: it only asks each party, while tracing, for
  its dataset's dtype and shape, then sends the program; the data are loaded where they live;
- the Simulator takes the cluster file as it is; the real parties here run on this machine, so
  the tutorial copies the file with the endpoints moved to free loopback ports (the data and
  outputs paths, made absolute, stay). On real hosts you would keep the endpoints and run
  `mpplug serve --config cluster.yaml --party NAME` on each (see docs/deployment.md);
- each run writes Carol's mean.npy again: the file declares `overwrite: true` for her outputs,
  so earlier runs never get in the way (without it, mp.write refuses to replace a file).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import yaml
from make_data import ensure_data

import mpplug as mp
from mpplug.config import ClusterSpec, PartySpec
from mpplug.remote.launch import LocalParties

EMPLOYERS = ("alice", "bob", "carol")


@mp.function
def salary_survey() -> dict[str, mp.MPObject]:
    """Three employers each hold some salaries as their dataset "salaries". Each sums its own,
    Carol receives the other two sums, computes the mean and keeps it in her outputs, and
    everyone gets only that mean back."""
    salaries = {party: mp.read(party, "salaries") for party in EMPLOYERS}
    count = sum(x.shape[0] for x in salaries.values())  # the shapes came from the parties
    sums = {party: mp.run_jax(jnp.sum, x) for party, x in salaries.items()}
    moved = [mp.p2p(party, "carol", sums[party]) for party in ("alice", "bob")]
    mean = mp.run_jax_at("carol", lambda *s: sum(s) / count, *moved, sums["carol"])
    mp.write("carol", "mean", mean)
    return {"mean": mp.bcast("carol", mean), "rank": mp.prank()}


def run(cluster: mp.Cluster, spec: ClusterSpec) -> dict[str, list[Any]]:
    """Run the program (it takes no inputs: the parties read their own) and fetch what every
    party holds; then show the file Carol wrote."""
    output = spec.party("carol").outputs
    assert output is not None, "the cluster file gives carol an outputs directory"
    written = output.path / "mean.npy"
    before = _stamp(written)
    out = cluster.evaluate(salary_survey)
    results = {key: cluster.fetch(value) for key, value in out.items()}
    saved = np.load(written)
    news = "a new file" if before is None else "replacing the earlier one"
    print(f"  carol wrote {written} ({news}): {saved}")
    assert _stamp(written) != before, "mp.write did not write the file"
    assert np.array_equal(saved, results["mean"][2]), "the file holds another value"
    return results


def on_free_ports(shipped: Path, copy: Path) -> Path:
    """Write `copy`: the cluster file `shipped` with every party at free loopback ports.
    Loading it resolved the data and outputs paths, so the copy holds them absolute."""
    spec = ClusterSpec.from_yaml(shipped)
    config = spec.to_dict()
    for party, local in zip(config["parties"], ClusterSpec.local(spec.names).parties, strict=True):
        party["endpoint"] = party["listen"] = local.endpoint
        party["bulk"] = local.bulk
    copy.write_text(yaml.safe_dump(config, sort_keys=False))
    return copy


def main() -> None:
    shipped = ensure_data()  # writes the data files on the first run
    spec = ClusterSpec.from_yaml(shipped)
    print(f"cluster file {shipped}:")
    for party in spec.parties:
        print(f"  {party.name}: {_describe(party, shipped.parent)}")

    # 1. The Simulator: every party a thread of this process, reading the same files.
    print("\n1. simulator")
    with mp.Simulator(shipped) as sim:
        simulated = run(sim, spec)
    print(f"  results: {_show(simulated)}")

    # 2. Real parties: one `python -m mpplug.remote.server` process each (what
    #    `mpplug up --config cluster.yaml` does), stopped when the block ends.
    print("\n2. driver and real party processes")
    with tempfile.TemporaryDirectory(prefix="mpplug-tutorial-") as tmp:
        config = on_free_ports(shipped, Path(tmp) / "cluster.yaml")
        moved = ClusterSpec.from_yaml(config).parties
        ports = ", ".join(f"{party.name} at {party.endpoint}" for party in moved)
        print(f"  a copy of the cluster file on free ports: {ports}")
        with LocalParties(config, log_dir=Path(tmp) / "logs") as parties:
            parties.start()
            parties.wait_ready(timeout=120)
            with mp.Driver(config) as driver:
                real = run(driver, spec)
    print(f"  results: {_show(real)}")

    same = all(
        all(np.array_equal(x, y) for x, y in zip(simulated[k], real[k], strict=True))
        for k in simulated
    )
    assert same, "the two clusters disagree"
    print("\nidentical results on the Simulator and on real party processes:", same)


def _describe(party: PartySpec, base: Path) -> str:
    """What the cluster file lets programs read and write at `party`."""
    found = [f"{d.name} <- {d.path.relative_to(base)}" for d in party.data]
    if party.outputs is not None:
        mode = "overwrite" if party.outputs.overwrite else "keep existing files"
        found.append(f"outputs -> {party.outputs.path.relative_to(base)}/ ({mode})")
    return ", ".join(found)


def _stamp(path: Path) -> int | None:
    """When `path` was last written (None: it does not exist)."""
    return path.stat().st_mtime_ns if path.exists() else None


def _show(results: dict[str, list[Any]]) -> str:
    return ", ".join(f"{key}={[v.tolist() for v in values]}" for key, values in results.items())


if __name__ == "__main__":
    main()
