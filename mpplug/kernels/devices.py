"""Device specs ("cpu", "cpu:1", "cuda:0") resolved to JAX devices, and their platforms.

Platform names follow `jax.export`: cpu, cuda, rocm, tpu.
"""

from __future__ import annotations

from typing import Any

import jax

from mpplug.errors import ConfigError

_BACKENDS = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "tpu": "tpu"}


def parse_device_spec(spec: str) -> tuple[str, int]:
    """Split "cuda:0" into ("cuda", 0); a bare "cpu" means index 0."""
    kind, colon, index = spec.partition(":")
    if kind not in _BACKENDS or (colon and not index.isdigit()):
        raise ConfigError(f"expected a device spec like 'cpu', 'cpu:1' or 'cuda:0', got {spec!r}")
    return kind, int(index or 0)


def resolve_device(spec: Any) -> Any:
    """The JAX device for a spec string, or `spec` itself if it already is a device."""
    if not isinstance(spec, str):
        return spec
    kind, index = parse_device_spec(spec)
    try:
        devices = jax.devices(_BACKENDS[kind])
    except RuntimeError as exc:
        raise ConfigError(f"device {spec!r}: no {kind} backend here ({exc})") from None
    if index >= len(devices):
        raise ConfigError(
            f"device {spec!r}: only {len(devices)} {kind} device(s) here "
            f"(indices 0..{len(devices) - 1})"
        )
    return devices[index]


def export_platform(device: Any) -> str:
    """The `jax.export` platform name of a JAX device (cuda/rocm for GPUs)."""
    platform = str(device.platform)
    if platform == "gpu":
        version = str(getattr(device.client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def default_export_platform() -> str:
    return export_platform(jax.devices()[0])
