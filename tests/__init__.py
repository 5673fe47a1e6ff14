"""The mpplug test suite; run it with `python -m pytest -n auto`.

tests/clusters.py lists the cluster kinds the conformance suite runs against.
"""
