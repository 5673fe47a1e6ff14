"""`mp.mpc`: secure computation on secret shares inside `@mp.function` programs.

`seal` shares values among three computing parties, `run` evaluates a JAX function on them
under the ABY3 protocol, and `reveal` opens results to the parties that should learn them.
"""

from mpplug.mpc.api import DEFAULT_FRAC_BITS, PROTOCOLS, reveal, run, seal
from mpplug.mpc.protocol import Protocol
from mpplug.mpc.sealed import Sealed

__all__ = ["DEFAULT_FRAC_BITS", "PROTOCOLS", "Protocol", "Sealed", "reveal", "run", "seal"]
