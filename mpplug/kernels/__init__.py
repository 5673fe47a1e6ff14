"""Kernels: the registry keyed by `fn_type`, the `jax.exec` plugin and builtin kernels.

Knows nothing of parties or programs; `invoke` runs one PFunction on one runtime.
"""

from mpplug.kernels.invoke import invoke
from mpplug.kernels.registry import REGISTRY, KernelRegistry, kernel
from mpplug.kernels.runtime import KernelRuntime, default_runtime

__all__ = ["REGISTRY", "KernelRegistry", "KernelRuntime", "default_runtime", "invoke", "kernel"]
