"""Real parties over gRPC: party servers, the party-to-party data plane and the `Driver`.

server runs one party (`python -m mpplug.remote.server`); service and peer are its RPCs,
session its drivers' leased value stores and limits what callers may hold; driver is the
Cluster that reaches the parties; streaming moves values in chunks; channels, tls and certs set
up (mutually authenticated) connections; status and launch check and start parties.
"""
