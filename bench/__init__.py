"""mpplug's benchmarks: run one as `python -m bench.<name>` from the repository root.

Each prints a table of ratios measured side by side in one run, then PASS or FAIL per target,
and exits 1 when a target is missed. A program's second run waits for the compiles it starts
(`MPPLUG_TIER_UP=wait`, inherited by the party processes a benchmark starts), so what a
benchmark times from the second run on is the compiled code a party reaches a little later
when its compiles go on in the background (the default).
"""

import os

os.environ.setdefault("MPPLUG_TIER_UP", "wait")
