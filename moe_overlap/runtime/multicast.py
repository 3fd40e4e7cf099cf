"""The NVLink multicast guard: multicast (NVLS) is forbidden on the shared machines.

Every host entry point of a multicast (``switch``) code path calls ``require_multicast()`` first,
which refuses unless multicast is explicitly allowed (``MOE_OVERLAP_ALLOW_MULTICAST=1`` or
``allow=True``) AND no environment switch disables it AND the device supports it. Nothing in this
package calls ``cuMulticastCreate``; a switch launch takes multicast addresses made elsewhere.
"""
import os

# Environment switches that mean "no NVLink multicast here" (all set on our machines).
MULTICAST_DISABLERS = (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"))
ALLOW_ENV = "MOE_OVERLAP_ALLOW_MULTICAST"


def _truthy(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


def multicast_unavailable_reason(allow: bool | None = None, device=None) -> str | None:
    """Why the ``switch`` backend may not run here (None when it may). Never creates a multicast
    object: it only reads the environment and a device attribute."""
    allowed = _truthy(os.environ.get(ALLOW_ENV, "")) if allow is None else bool(allow)
    if not allowed:
        return (f"NVLink multicast is not explicitly allowed (set {ALLOW_ENV}=1 or pass "
                f"allow=True where multicast is permitted; it is forbidden on the shared machines)")
    for name, off in MULTICAST_DISABLERS:
        v = os.environ.get(name)
        if v is not None and (v.strip() == off or (off == "1" and _truthy(v))):
            return f"NVLink multicast is disabled in this environment ({name}={v})"
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        idx = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    except Exception as e:  # pragma: no cover
        return f"CUDA is not usable: {e}"
    try:
        import cuda.bindings.driver as drv
        err, dev = drv.cuDeviceGet(idx)
        if err != drv.CUresult.CUDA_SUCCESS:
            return f"cuDeviceGet({idx}) failed: {err}"
        err, ok = drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev)
        if err != drv.CUresult.CUDA_SUCCESS or not ok:
            return f"device {idx} does not support NVLink multicast"
    except Exception as e:  # pragma: no cover
        return f"cannot query multicast support: {e}"
    return None


def require_multicast(allow: bool | None = None, device=None) -> None:
    """Raises RuntimeError unless NVLink multicast is explicitly allowed AND available."""
    why = multicast_unavailable_reason(allow, device)
    if why is not None:
        raise RuntimeError(f"the 'switch' (NVLink multicast) backend refuses to run: {why}. "
                           f"Use the 'unicast' backend.")
