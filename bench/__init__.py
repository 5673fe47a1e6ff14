"""mpplug's benchmarks: run one as `python -m bench.<name>` from the repository root.

Each prints a table of ratios measured side by side in one run, then PASS or FAIL per target,
and exits 1 when a target is missed.
"""
