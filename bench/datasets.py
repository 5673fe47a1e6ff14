"""Memory of reading a 1 GiB dataset: `mp.read` of a memory-mapped .npy at a party, next to
loading the file on the driver and `put`ting it; peak RSS of each in a fresh process.
Run as `python -m bench.datasets`."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from bench.timing import Target, verdict

SIZE_BYTES = 2**30
TARGET = 1.5
"""Peak RSS growth per byte of the file: the data may be copied once, into the computation."""

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    import mpplug as mp
    from mpplug.config import ClusterSpec

    path, how = sys.argv[1], sys.argv[2]
    spec = ClusterSpec.from_dict({"parties": [
        {"name": "alice", "endpoint": "127.0.0.1:1", "data": {"big": path}},
    ]})
    total = mp.function(lambda x: mp.run_jax(lambda a: a.sum(dtype="float64"), x))
    with mp.Simulator(spec) as sim:
        warm = sim.put(0, np.ones(4, np.float32))
        sim.fetch(sim.evaluate(total, warm), party=0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if how == "read":
            out = sim.evaluate(mp.function(lambda: total(mp.read("alice", "big"))))
        else:
            out = sim.evaluate(total, sim.put(0, np.load(path)))
        value = float(sim.fetch(out, party=0))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew": (peak - before) * 1024, "sum": value}))
    """
)


def peak_growth(path: Path, how: str) -> tuple[int, float]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), how],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return int(result["grew"]), float(result["sum"])


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mpplug-bench-data-") as tmp:
        path = Path(tmp) / "big.npy"
        data = np.lib.format.open_memmap(
            path, mode="w+", dtype=np.float32, shape=(SIZE_BYTES // 4,)
        )
        data[:] = 1.0
        data.flush()
        del data
        grew_read, total_read = peak_growth(path, "read")
        grew_put, total_put = peak_growth(path, "put")
    expected = float(SIZE_BYTES // 4)
    assert total_read == expected == total_put, (total_read, total_put, expected)
    ratio_read, ratio_put = grew_read / SIZE_BYTES, grew_put / SIZE_BYTES
    rows = [
        (
            "mp.read of a 1 GiB .npy at the party, then a sum there",
            f"{grew_read / 2**20:.0f} MiB",
            f"{ratio_read:.2f}x the file",
        ),
        (
            "np.load on the driver, put, then the same sum (for reference)",
            f"{grew_put / 2**20:.0f} MiB",
            f"{ratio_put:.2f}x the file",
        ),
    ]
    print("mpplug dataset memory benchmark (Simulator, peak RSS growth in a fresh process)\n")
    print("| measurement | peak RSS growth | ratio |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    target = Target(
        f"mp.read peak RSS growth <= {TARGET}x the file", ratio_read <= TARGET, f"{ratio_read:.2f}x"
    )
    return verdict([target])


if __name__ == "__main__":
    sys.exit(main())
