"""Array interop: which framework an array comes from, host or device, and conversions.

The framework is read from the type's module name, so no framework is imported just to check.
Device arrays (CuPy, PyTorch CUDA, JAX GPU) become CuPy views through DLPack (no copy); host
arrays (NumPy, PyTorch CPU, JAX CPU) become NumPy views. Results go back in the caller's
framework.
"""

from __future__ import annotations

import numpy as np

HOST, DEVICE = "host", "device"


def framework_of(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod in ("numpy", "cupy", "torch", "jax", "jaxlib"):
        return "jax" if mod == "jaxlib" else mod
    if isinstance(x, (list, tuple, int)):
        return "numpy"
    raise TypeError(
        f"unsupported array type {type(x).__module__}.{type(x).__name__}: "
        "expected a NumPy, CuPy, PyTorch or JAX array"
    )


def placement(x) -> str:
    fw = framework_of(x)
    if fw == "numpy":
        return HOST
    if fw == "cupy":
        return DEVICE
    if fw == "torch":
        return DEVICE if x.is_cuda else HOST
    # JAX
    devices = x.devices() if hasattr(x, "devices") else {x.device()}
    return DEVICE if any(d.platform == "gpu" for d in devices) else HOST


def to_native(x, where: str):
    """A NumPy (host) or CuPy (device) view of ``x``; ``None`` stays ``None``."""
    if x is None:
        return None
    fw = framework_of(x)
    if where == HOST:
        if fw == "torch":
            return x.detach().numpy()
        return np.asarray(x)
    import cupy

    if fw == "cupy":
        return x
    return cupy.from_dlpack(x)


def classify(named_arrays: dict):
    """Return ``(where, framework)`` for the given arrays, raising on a host/device mix."""
    where = framework = None
    first = None
    for name, x in named_arrays.items():
        if x is None:
            continue
        try:
            w = placement(x)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        if where is None:
            where, framework, first = w, framework_of(x), name
        elif w != where:
            raise ValueError(
                f"{name} is a {w} array but {first} is a {where} array: "
                "pass all arrays on the host or all on the same GPU"
            )
    return where or HOST, framework or "numpy"


def from_native(x, framework: str):
    """Return a NumPy/CuPy result ``x`` as an array of ``framework`` (zero copy)."""
    if framework in ("numpy", "cupy"):
        return x
    if framework == "torch":
        import torch

        return torch.from_dlpack(x) if not isinstance(x, np.ndarray) else torch.from_numpy(x)
    import jax.numpy as jnp

    return jnp.from_dlpack(x) if not isinstance(x, np.ndarray) else jnp.asarray(x)


def caller_stream(framework: str, device_id: int, stream=None):
    """The CuPy stream the call is ordered on: the given one, else the framework's current."""
    import cupy

    if stream is not None:
        if isinstance(stream, cupy.cuda.Stream):
            return stream
        return cupy.cuda.Stream.from_external(stream)
    if framework == "torch":
        import torch

        return cupy.cuda.Stream.from_external(torch.cuda.current_stream(device_id))
    return cupy.cuda.get_current_stream()
