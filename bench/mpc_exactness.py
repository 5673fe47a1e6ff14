"""How often is an `mp.mpc` fixed-point product wrong, per magnitude decade of |x*y|, under
precise truncation (the default) and under `truncation="probabilistic"`; prints one table, and
with `--spu spu_exact.json` (the SPU anchor's spu_exactness.py --json) SPU's counts beside.

    python -m bench.mpc_exactness [--per-decade 1e8 | --quick] [--spu FILE] [--json FILE]

Data, per decade k (mag = 10^k, k = 0..7) exactly as the SPU script draws them: a generator
`default_rng([seed, k])`, per chunk u = uniform(0.5, 1.5), v = uniform(0.5, 1.5), sgn in {0, 1},
x = (2 sgn - 1) u sqrt(mag), y = v sqrt(mag), so |x*y| lies in [0.25, 2.25] mag; a last row,
"edge", puts mag at 2^26 / 2.25 so the largest products touch the range limit 2^(62 - 2f).
Program: `reveal(run(lambda u, v: u * v, *seal((x, y), truncation=...)), to=0)` on the
Simulator, x at party 0 and y at party 1, in chunks of --chunk products.

Counted per decade and truncation:
- off (SPU's test): |result - x*y| > 1e-3 + 1e-6 mag against float64 x*y, as spu_exactness.py;
- off by more than one ulp: the result's ring value r against the exact ring product
  p = round(x 2^f) round(y 2^f) (int64, exact below 2^63): r - floor(p / 2^f) outside {0, 1}.
  Precise truncation promises 0 here; the input rounding is not counted;
- the worst absolute error against float64 x*y.
Target: 0 products off (either count) under precise truncation at every magnitude; exit code 1
when one is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

import mpplug as mp

F = mp.mpc.DEFAULT_FRAC_BITS
LIMIT = 2.0 ** (62 - 2 * F)
TRUNCATIONS = ("precise", "probabilistic")
RECV_TIMEOUT_S = 120.0


def tolerance(mag: float) -> float:
    """The SPU script's 'off' threshold."""
    return 1e-3 + 1e-6 * mag


@dataclass
class Row:
    decade: str
    mag: float
    truncation: str
    products: int = 0
    off: int = 0
    off_ulp: int = 0
    worst_abs: float = 0.0
    seconds: float = 0.0


@mp.function
def product(x: Any, y: Any, truncation: str) -> Any:
    a, b = mp.mpc.seal((x, y), truncation=truncation)
    return mp.mpc.reveal(mp.mpc.run(lambda u, v: u * v, a, b), to=0)


def decades() -> list[tuple[str, float, int]]:
    """(label, mag, generator index): the SPU script's decades 1..1e7, then the edge."""
    rows = [(f"1e{k}", 10.0**k, k) for k in range(8)]
    return [*rows, ("edge 2^26", LIMIT / 2.25 * 0.999, 8)]


def measure(sim: Any, label: str, mag: float, k: int, args: argparse.Namespace) -> list[Row]:
    rows = {t: Row(label, mag, t) for t in args.truncations}
    rng = np.random.default_rng([args.seed, k])
    done = 0
    while done < args.per_decade:
        c = min(args.chunk, args.per_decade - done)
        u, v = rng.uniform(0.5, 1.5, c), rng.uniform(0.5, 1.5, c)
        sgn = rng.integers(0, 2, c)
        x, y = (2 * sgn - 1) * u * np.sqrt(mag), v * np.sqrt(mag)
        exact = np.round(x * 2.0**F).astype(np.int64) * np.round(y * 2.0**F).astype(np.int64)
        floor = exact >> F
        hx, hy = sim.put(0, x), sim.put(1, y)
        for truncation, row in rows.items():
            start = time.perf_counter()
            z = sim.fetch(sim.evaluate(product, hx, hy, truncation), party=0)
            row.seconds += time.perf_counter() - start
            err = np.abs(z - x * y)
            offset = np.round(z * 2.0**F).astype(np.int64) - floor
            row.products += c
            row.off += int((err > tolerance(mag)).sum())
            row.off_ulp += int(((offset < 0) | (offset > 1)).sum())
            row.worst_abs = max(row.worst_abs, float(err.max()))
        done += c
    return list(rows.values())


def load_spu(path: str | None) -> dict[float, dict[str, Any]]:
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    return {round(r["mag"]): r for r in data["rows"]}


def table(rows: list[Row], spu: dict[float, dict[str, Any]]) -> tuple[str, bool]:
    by = {(r.decade, r.truncation): r for r in rows}
    labels = list(dict.fromkeys(r.decade for r in rows))
    head = ["abs(x*y) ~", "products"]
    for t in TRUNCATIONS:
        if any(r.truncation == t for r in rows):
            head += [f"{t}: off", f"{t}: off > 1 ulp", f"{t}: worst abs error"]
    if spu:
        head += ["SPU products", "SPU off", "SPU worst abs error"]
    head.append("target (precise: 0 off)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missed = False
    for label in labels:
        first = next(r for r in rows if r.decade == label)
        cells = [label, f"{first.products:,}"]
        for t in TRUNCATIONS:
            r = by.get((label, t))
            if r is not None:
                cells += [f"{r.off:,}", f"{r.off_ulp:,}", f"{r.worst_abs:.3g}"]
        if spu:
            s = spu.get(round(first.mag))
            cells += (
                [f"{s['products']:,}", f"{s['off']:,}", f"{s['worst_abs']:.3g}"]
                if s
                else ["-", "-", "-"]
            )
        precise = by.get((label, "precise"))
        if precise is None:
            cells.append("n/a")
        else:
            ok = precise.off == 0 and precise.off_ulp == 0
            missed |= not ok
            cells.append("PASS" if ok else "FAIL")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-decade", type=float, default=1e8, help="products per decade")
    ap.add_argument("--quick", action="store_true", help="1e6 products per decade")
    ap.add_argument("--chunk", type=float, default=2e6, help="products per evaluate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=TRUNCATIONS, help="measure one truncation only")
    ap.add_argument("--spu", help="spu_exactness.py's --json output, shown beside ours")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    args.per_decade = int(1e6 if args.quick else args.per_decade)
    args.chunk = int(min(args.chunk, args.per_decade))
    args.truncations = (args.only,) if args.only else TRUNCATIONS
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"mpplug {mp.__version__} product exactness: Simulator(3), ABY3 Z_2^64, {F} fraction "
        f"bits; {args.per_decade:,} products per decade in chunks of {args.chunk:,}; seed "
        f"{args.seed}; jax {jax.__version__}, numpy {np.__version__}, python "
        f"{platform.python_version()}, {os.cpu_count()} cores, load avg {load:.2f}",
        flush=True,
    )
    rows: list[Row] = []
    start = time.perf_counter()
    with mp.Simulator(3, timeout=RECV_TIMEOUT_S) as sim:
        for label, mag, k in decades():
            for row in measure(sim, label, mag, k, args):
                rows.append(row)
                print("  " + json.dumps(asdict(row)), flush=True)
    print(f"  ({time.perf_counter() - start:.0f} s in all)\n")
    text, missed = table(rows, load_spu(args.spu))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    verdict = "FAIL" if missed else "PASS"
    print(f"\n{verdict}: precise truncation, 0 products off at every magnitude")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
