"""The per-party runtime: interpreter, communicator, wire codec and the `Cluster` interface.

Knows nothing of gRPC; the simulator and the remote driver build on it.
"""
