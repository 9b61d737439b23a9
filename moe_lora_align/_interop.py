"""Array interop: which framework an array comes from, host or device, and conversions.

The framework is read from the type's module name, so no framework is imported just to check.
Device arrays become CuPy views without a copy (PyTorch CUDA tensors from their pointers, JAX
GPU arrays through DLPack); host arrays (NumPy, PyTorch CPU, JAX CPU) become NumPy views.
Results go back in the caller's framework. Objects of other libraries are taken through the
array protocols: on the GPU ``__cuda_array_interface__`` or ``__dlpack__`` (answered as CuPy
arrays), on the host ``__dlpack__`` or ``__array__`` (answered as NumPy arrays).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import numpy as np

HOST, DEVICE = "host", "device"


FRAMEWORKS = ("numpy", "cupy", "torch", "jax")
PROTOCOLS = ("cuda_array_interface", "dlpack", "array")  # objects of other libraries
_KDL_CUDA = (2, 13)  # DLPack device types of CUDA memory (device, managed)


def framework_of(x) -> str:
    """One of FRAMEWORKS, or of PROTOCOLS for another library's array."""
    mod = type(x).__module__.split(".")[0]
    if mod in ("numpy", "cupy", "torch", "jax", "jaxlib"):
        if mod in ("jax", "jaxlib") and "Tracer" in type(x).__name__:
            raise TypeError("moe_lora_align cannot run inside jax.jit (or another JAX "
                            "transformation): its outputs' sizes and its kernels are chosen "
                            "from concrete arrays; call it outside jit")
        return "jax" if mod == "jaxlib" else mod
    if isinstance(x, (list, tuple, int)):
        return "numpy"
    torch = sys.modules.get("torch")  # a subclass defined outside torch is still a tensor
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if hasattr(x, "__cuda_array_interface__"):
        return "cuda_array_interface"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    if hasattr(x, "__array__"):
        return "array"
    raise TypeError(
        f"unsupported array type {type(x).__module__}.{type(x).__name__}: expected a NumPy, "
        "CuPy, PyTorch or JAX array, or an object with __cuda_array_interface__, __dlpack__ "
        "or __array__"
    )


def placement(x) -> str:
    fw = framework_of(x)
    if fw == "numpy":
        return HOST
    if fw == "cupy":
        return DEVICE
    if fw == "torch":
        return DEVICE if x.is_cuda else HOST
    if fw == "cuda_array_interface":
        return DEVICE
    if fw == "dlpack":
        return DEVICE if int(x.__dlpack_device__()[0]) in _KDL_CUDA else HOST
    if fw == "array":
        return HOST
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
        if fw == "dlpack":
            return np.from_dlpack(x)
        return np.asarray(x)
    import cupy

    if fw == "cupy":
        return x
    if fw == "cuda_array_interface":
        return cupy.asarray(x)  # a view: the interface hands over the pointer
    if fw == "torch":
        return _torch_view(x)
    return cupy.from_dlpack(x)


_TORCH_DTYPES: dict = {}  # torch dtype -> NumPy dtype (None: one NumPy lacks, e.g. bfloat16)


def _torch_view(x):
    """A CuPy view of a CUDA tensor made from its pointer. DLPack would make CuPy's current
    stream wait on torch's, a dependency on the legacy stream that a torch graph capture
    refuses; the call instead orders its own work on the caller's stream (``ordered_on``)."""
    import cupy

    dtype = _TORCH_DTYPES.get(x.dtype, False)
    if dtype is False:
        try:
            dtype = np.dtype(str(x.dtype).split(".")[-1])
        except TypeError:
            dtype = None
        _TORCH_DTYPES[x.dtype] = dtype
    if dtype is None:
        return cupy.from_dlpack(x)  # refused by the dtype checks that follow
    shape, steps = tuple(x.shape), tuple(x.stride())
    item = dtype.itemsize
    if x.numel() == 0:
        with cupy.cuda.Device(x.get_device()):  # its device, for the same-device check
            return cupy.ndarray(shape, dtype)
    extent = (1 + sum((n - 1) * s for n, s in zip(shape, steps))) * item
    mem = cupy.cuda.UnownedMemory(x.data_ptr(), extent, x, x.get_device())
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0),
                        tuple(s * item for s in steps))


def classify(named_arrays: dict, exempt=()):
    """Return ``(where, framework)`` for the given arrays (the framework the answer comes
    back in), raising on a host/device mix and on arrays of two frameworks in one call
    (plain Python data and other libraries' protocol arrays aside; names in ``exempt`` are
    not compared: an AlignPlan's own buffers)."""
    where = framework = None
    first = None
    first_known = None  # (name, framework) of the first array of a named framework
    for name, x in named_arrays.items():
        if x is None:
            continue
        try:
            w = placement(x)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        fw = framework_of(x)
        if where is None:
            where, framework, first = w, fw, name
        elif w != where:
            raise ValueError(
                f"{name} is a {w} array but {first} is a {where} array: "
                "pass all arrays on the host or all on the same GPU"
            )
        if fw in FRAMEWORKS and name not in exempt and not isinstance(x, (list, tuple, int)):
            if first_known is None:
                first_known = (name, fw)
            elif fw != first_known[1]:
                raise ValueError(f"{name} is a {fw} array but {first_known[0]} is a "
                                 f"{first_known[1]} array: pass the arrays of one call from "
                                 "one framework")
    if framework in PROTOCOLS:
        framework = "cupy" if where == DEVICE else "numpy"
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


@functools.lru_cache(maxsize=None)
def torch_bumper():
    """A function that takes a tuple of torch tensors written in place and raises their
    version counters, as torch's own in-place ops do: autograd then refuses a backward that
    would read a saved tensor this call overwrote. Tensors made in inference mode have no
    counter and are left alone, as torch's custom ops leave them."""
    import torch

    bump = torch._C._increment_version
    try:
        bump(())  # releases that take a sequence of tensors: one call for all
    except TypeError:
        return lambda tensors: [bump(t) for t in tensors]
    return bump


def torch_written(arrays) -> None:
    """Raise the version counters of the torch tensors among ``arrays`` (``torch_bumper``)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        tensors = tuple(x for x in arrays if isinstance(x, torch.Tensor))
        if tensors:
            torch_bumper()(tensors)


@contextlib.contextmanager
def ordered_on(framework: str, device_id: int, stream=None):
    """CuPy's current device and stream set to the call's, for the device work a full call
    does itself (a copy of a strided input, value checks): ordered with the caller's work."""
    import cupy

    with cupy.cuda.Device(device_id), caller_stream(framework, device_id, stream):
        yield


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
