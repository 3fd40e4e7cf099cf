"""A check that code makes no host synchronization and no data-dependent size (what a CUDA graph
capture or a sync-free path forbids), usable on the CPU.

``no_host_sync()``: a context in which every aten op is inspected (TorchDispatchMode) and a
``HostSyncError`` is raised for
- a read of a tensor's value on the host: ``_local_scalar_dense`` (``.item()``, ``int(t)``,
  ``bool(t)``, ``float(t)``), ``equal``, ``is_nonzero``;
- an op whose output size depends on the data: ``nonzero``, ``argwhere``, ``masked_select``,
  the ``unique`` family, ``bincount`` (its length is max + 1: on CUDA it reads the max),
  ``repeat_interleave`` without output_size, and indexing or index_put with a boolean mask;
- a copy between devices (``_to_copy`` / ``copy_`` changing the device: a host read, or a host
  tensor made inside the code);
and ``Tensor.tolist`` / ``Tensor.numpy`` / ``Tensor.__array__``, which read memory without an
aten op. ``ops`` on the context lists every op seen (to check the mode saw the code at all).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.equal", "aten.is_nonzero"}
DYNAMIC_OPS = {"aten.nonzero", "aten.nonzero_numpy", "aten.argwhere", "aten.masked_select",
               "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
               "aten.unique_dim_consecutive", "aten.bincount"}
INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_",
             "aten._unsafe_index", "aten._unsafe_index_put"}


class HostSyncError(AssertionError):
    pass


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


class _NoSync(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops.add(name)
        if name in SYNC_OPS:
            raise HostSyncError(f"{func}: reads a tensor's value on the host")
        if name in DYNAMIC_OPS:
            raise HostSyncError(f"{func}: output size depends on the data")
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            raise HostSyncError(f"{func} without output_size: output size depends on the data")
        if name in INDEX_OPS:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(idx)):
                raise HostSyncError(f"{func} with a boolean mask: output size depends on the data")
        if name == "aten._to_copy" and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]) != args[0].device:
            raise HostSyncError(f"{func}: copy from {args[0].device} to {kwargs['device']}")
        if name == "aten.copy_" and args[0].device != args[1].device:
            raise HostSyncError(f"{func}: copy from {args[1].device} to {args[0].device}")
        return func(*args, **kwargs)


def _refuse(what):
    def f(*args, **kwargs):
        raise HostSyncError(f"Tensor.{what}: reads a tensor's memory on the host")
    return f


@contextlib.contextmanager
def no_host_sync():
    """Raise HostSyncError at the first host read / data-dependent size inside the block;
    yields the mode (``.ops``: the aten ops seen)."""
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy", "__array__")}
    mode = _NoSync()
    try:
        for n in saved:
            setattr(torch.Tensor, n, _refuse(n))
        with mode:
            yield mode
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
