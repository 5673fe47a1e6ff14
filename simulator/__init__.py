"""The thread simulator: N parties in one process behind the `mpplug.Cluster` interface.

For tests and local work; results match real parties because the same bytes and codec are used.
"""

from simulator.simulator import InMemoryCommunicator, Simulator

__all__ = ["InMemoryCommunicator", "Simulator"]
