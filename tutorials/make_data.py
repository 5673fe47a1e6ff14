"""Writes the tutorials' party datasets, the files that tutorials/data/cluster.yaml names.

The data are synthetic and drawn from fixed seeds, so every run writes the same bytes; files
that already exist are left alone (`--force` writes them again). The tutorials call
`ensure_data()` first, so a fresh clone works from any working directory:

    python tutorials/make_data.py            # what the tutorials do on their first run

What it writes under tutorials/data/ (none of it is committed; see data/.gitignore):

- alice/salaries.npy, bob/payroll.npz (array "salaries"), carol/salaries.csv: four salaries
  each, one file format per party (tutorial 03);
- alice/features.npy and bob/features.npy: 8 standardized features each of the same 2,000
  people, and carol/labels.npy: their 0/1 labels, drawn from a logistic model (tutorial 05);
- holdout.npz: 1,000 more people, all 16 features ("x") and labels ("y"), that only the
  tutorial's plaintext yardstick reads, to judge the trained models.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

DATA_DIR = Path(__file__).resolve().parent / "data"
CLUSTER_FILE = DATA_DIR / "cluster.yaml"
HOLDOUT_FILE = DATA_DIR / "holdout.npz"

SALARY_SEED = 7
SALARIES_PER_PARTY = 4
LOGISTIC_SEED = 2024
N_TRAIN, N_TEST, N_FEATURES = 2_000, 1_000, 16
SPLIT = 8  # alice holds features 0..7, bob 8..15

Array = np.ndarray[Any, Any]
Writer = Callable[[BinaryIO], None]


def salaries() -> dict[str, Array]:
    """Four salaries per employer (float64, whole units)."""
    rng = np.random.default_rng(SALARY_SEED)
    return {
        party: rng.integers(30_000, 90_000, size=SALARIES_PER_PARTY).astype(np.float64)
        for party in ("alice", "bob", "carol")
    }


def logistic_data() -> dict[str, Array]:
    """Standardized features and labels drawn from a logistic model: a training split,
    vertically partitioned, and a held-out test split."""
    rng = np.random.default_rng(LOGISTIC_SEED)
    x = rng.normal(size=(N_TRAIN + N_TEST, N_FEATURES))
    true_w = rng.normal(size=N_FEATURES)
    p = 1.0 / (1.0 + np.exp(-(x @ true_w + 0.5)))
    y = (rng.random(len(x)) < p).astype(np.float64)
    train, test = slice(0, N_TRAIN), slice(N_TRAIN, None)
    return {
        "alice": x[train, :SPLIT],
        "bob": x[train, SPLIT:],
        "labels": y[train],
        "x_test": x[test],
        "y_test": y[test],
    }


def _npy(array: Callable[[], Array]) -> Writer:
    """Writes the array as a .npy file."""
    return lambda out: np.save(out, array(), allow_pickle=False)


def _save_holdout(out: BinaryIO) -> None:
    data = logistic_data()
    np.savez(out, x=data["x_test"], y=data["y_test"])


FILES: dict[str, Writer] = {
    # relative to DATA_DIR: how to write it (the draws happen only when a file is missing)
    "alice/salaries.npy": _npy(lambda: salaries()["alice"]),
    "bob/payroll.npz": lambda out: np.savez(out, salaries=salaries()["bob"]),
    "carol/salaries.csv": lambda out: np.savetxt(out, salaries()["carol"], fmt="%.2f"),
    "alice/features.npy": _npy(lambda: logistic_data()["alice"]),
    "bob/features.npy": _npy(lambda: logistic_data()["bob"]),
    "carol/labels.npy": _npy(lambda: logistic_data()["labels"]),
    "holdout.npz": _save_holdout,
}


def ensure_data(*, force: bool = False, quiet: bool = False) -> Path:
    """Write whichever data files are missing (all of them with `force`); return the path
    of the cluster file that declares them."""
    for relative, write in FILES.items():
        target = DATA_DIR / relative
        if target.exists() and not force:
            continue
        _write_atomically(target, write)
        if not quiet:
            print(f"make_data: wrote {target}")
    return CLUSTER_FILE


def _write_atomically(target: Path, write: Writer) -> None:
    """Write through a temporary file and a rename, so that a tutorial running at the same
    time never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = parser.parse_args()
    ensure_data(force=args.force)
    print(f"make_data: the cluster file is {CLUSTER_FILE}")


if __name__ == "__main__":
    main()
