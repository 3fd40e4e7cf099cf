"""Facts of the CUDA devices, queried once per device."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    share = context_sm_count(index)  # first: it creates the context the share belongs to
    total = torch.cuda.get_device_properties(index).multi_processor_count
    return total if share is None else min(total, share)


def num_sms(device) -> int:
    """Streaming multiprocessors this process's kernels may use on a CUDA device (cached): the
    device's count, or less where the context is limited to a share of it (MPS with
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: ``context_sm_count``). Every persistent grid of the
    library is sized from this, so ranks sharing a GPU under MPS do not wait on CTAs that cannot
    be resident."""
    idx = device if isinstance(device, int) else torch.device(device).index
    return _num_sms(torch.cuda.current_device() if idx is None else idx)


def context_sm_count(index: int) -> int | None:
    """The SM count of the execution affinity of this process's context on GPU ``index``
    (``cuCtxGetExecAffinity``: under MPS its share of the GPU), or None where the driver cannot
    tell. Creates the context first: device properties read before the context existed (and
    cached by torch) show the whole GPU even under MPS."""
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver: no context to ask (a machine without a GPU)
        return None
    with torch.cuda.device(index):
        torch.empty(1, device=f"cuda:{index}")  # the primary context, current on this thread
        torch.cuda.synchronize()
        try:
            from cuda.bindings import driver as drv
        except ImportError:
            drv = None
        if drv is not None:
            err, aff = drv.cuCtxGetExecAffinity(
                drv.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT)
            val = int(aff.param.smCount.val) if err == drv.CUresult.CUDA_SUCCESS else 0
            return val if val > 0 else None
        return _context_sm_count_ctypes()


def _context_sm_count_ctypes() -> int | None:
    """``cuCtxGetExecAffinity`` through libcuda directly (where cuda-python is not installed)."""
    import ctypes

    class _Param(ctypes.Structure):  # CUexecAffinityParam: {type, union {smCount {val}}}
        _fields_ = [("type", ctypes.c_int), ("val", ctypes.c_uint)]

    try:
        fn = ctypes.CDLL("libcuda.so.1").cuCtxGetExecAffinity
    except (OSError, AttributeError):
        return None
    p = _Param()
    if fn(ctypes.byref(p), ctypes.c_int(0)) != 0:  # 0: CU_EXEC_AFFINITY_TYPE_SM_COUNT
        return None
    return int(p.val) if p.val > 0 else None


def device_uuid(index: int) -> bytes:
    """16 bytes naming GPU ``index`` of this process: its UUID (the same in every process that
    uses that GPU, whatever CUDA_VISIBLE_DEVICES renumbers), hashed from torch's text form where
    the raw bytes are not exposed."""
    import hashlib
    props = torch.cuda.get_device_properties(index)
    u = getattr(props, "uuid", None)
    if u is None:  # an old torch: the PCI location on this host
        import socket
        u = (f"{socket.gethostname()}:{getattr(props, 'pci_domain_id', 0)}:"
             f"{getattr(props, 'pci_bus_id', index)}:{getattr(props, 'pci_device_id', 0)}")
    raw = getattr(u, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        return bytes(raw)
    return hashlib.blake2b(str(u).encode(), digest_size=16).digest()


def ranks_share_device(group, device) -> bool:
    """Collective over ``group``: True on every rank when two ranks of the group run on one GPU
    (the one-GPU multi-rank mode, MPS or time-sliced), from every rank's ``device_uuid``; the
    allocators that refuse such ranks (torch symmetric memory) are chosen by it."""
    from . import collectives
    import torch.distributed as dist
    world = dist.get_world_size(group)
    if world == 1:
        return False
    idx = device if isinstance(device, int) else torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    # NCCL gathers CUDA tensors, the other backends host ones (nothing to stage)
    on = torch.device("cpu") if collectives.stages_cuda(group) else torch.device("cuda", idx)
    mine = torch.frombuffer(bytearray(device_uuid(idx)), dtype=torch.int64).to(on)
    parts = [torch.empty_like(mine) for _ in range(world)]
    collectives.all_gather(parts, mine, group=group)
    return len({tuple(p.tolist()) for p in parts}) < world


def require_sm_share(sms: int, needed: int, what: str) -> None:
    """ValueError unless ``needed`` SMs fit in this process's ``sms`` (its share of the GPU)."""
    if needed > sms:
        raise ValueError(f"{what} needs {needed} SMs at once but this process may use {sms} "
                         "(under MPS: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the GPU); run fewer "
                         "ranks per GPU or lower ccta")


# ---- co-residency of spinning kernels ----------------------------------------------------------
# A kernel whose CTA c waits on CTA c of the peers (the band all-reduce) hangs until its timeout
# unless every CTA of every rank is resident at once; the bound below is computed from the
# kernel's own registers and shared memory (read from its cubin), so it holds before any launch.
SM90_LIMITS = dict(threads=2048, regs=65536, ctas=32, smem=228 * 1024, reg_unit=256,
                   smem_reserved=1024)


def cubin_resources(cubin: bytes) -> dict:
    """{kernel name: (registers per thread, static shared bytes)} from a cubin's ELF
    (``.nv.info`` EIATTR_REGCOUNT, ``.nv.shared.<kernel>`` sizes)."""
    import struct
    b = bytes(cubin)
    if b[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", b, shoff + i * shentsize) for i in range(shnum)]
    names_off = secs[shstrndx][4]

    def cstr(off):
        return b[off:b.index(b"\0", off)].decode()

    named = {cstr(names_off + s[0]): (s[4], s[5]) for s in secs}
    symtab, strtab = named.get(".symtab"), named.get(".strtab")
    syms = []
    if symtab and strtab:
        for i in range(symtab[1] // 24):
            st_name, = struct.unpack_from("<I", b, symtab[0] + 24 * i)
            syms.append(cstr(strtab[0] + st_name))
    regs = {}
    off, size = named.get(".nv.info", (0, 0))
    i = 0
    while i + 4 <= size:
        fmt, attr, sz = struct.unpack_from("<BBH", b, off + i)
        if fmt == 4:  # EIFMT_SVAL: sz bytes of payload
            if attr == 0x2F and sz >= 8:  # EIATTR_REGCOUNT: (symbol index, registers)
                sym, n = struct.unpack_from("<II", b, off + i + 4)
                regs[syms[sym] if sym < len(syms) else str(sym)] = n
            i += 4 + sz
        else:  # EIFMT_NVAL / BVAL / HVAL: the value is in the 16-bit field
            i += 4
    out = {}
    for name, n in regs.items():
        smem = named.get(f".nv.shared.{name}", (0, 0))[1]
        out[name] = (n, smem)
    return out


def ctas_per_sm(regs: int, threads: int, smem: int = 0, limits: dict = SM90_LIMITS) -> int:
    """CTAs of one kernel that fit on one SM by threads, registers (allocated per warp in units of
    ``reg_unit``) and shared memory (0: it cannot run at all)."""
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // limits["reg_unit"]) * limits["reg_unit"]
    by_regs = limits["regs"] // (per_warp * warps)
    by_threads = limits["threads"] // (warps * 32)
    by_smem = limits["smem"] // (smem + limits["smem_reserved"])
    return max(0, min(by_regs, by_threads, by_smem, limits["ctas"]))


def require_coresident(grid: int, sms: int, per_sm: int, what: str) -> None:
    """ValueError unless ``grid`` CTAs fit at once on ``sms`` SMs at ``per_sm`` CTAs each."""
    if per_sm < 1:
        raise ValueError(f"{what}: one CTA does not fit on an SM (registers / shared memory); "
                         "its CTAs wait on each other across ranks, so every CTA must be "
                         "resident: use fewer threads or a smaller unroll")
    if grid > sms * per_sm:
        raise ValueError(f"{what}: grid of {grid} CTAs but only {sms} SMs x {per_sm} CTAs per SM "
                         f"= {sms * per_sm} can be resident at once; its CTAs wait on each other "
                         "across ranks (a CTA that is not resident never arrives): lower ccta / "
                         "the grid")
