"""Party sets: which ranks hold a value or run an op.

A party set is a frozenset of ranks; these helpers validate and print them.
"""

from __future__ import annotations

from collections.abc import Iterable

PartySet = frozenset[int]


def party_set(ranks: Iterable[int], world_size: int, where: str = "parties") -> PartySet:
    """Validate ranks against `world_size` and return them as a non-empty frozenset."""
    result = frozenset(ranks)
    bad = sorted(r for r in result if not isinstance(r, int) or not 0 <= r < world_size)
    if bad:
        raise ValueError(f"{where}: expected ranks in 0..{world_size - 1}, got {bad}")
    if not result:
        raise ValueError(f"{where}: expected at least one party, got none")
    return result


def format_parties(parties: Iterable[int]) -> str:
    """Print a party set as `{0,2}`."""
    return "{" + ",".join(map(str, sorted(parties))) + "}"
