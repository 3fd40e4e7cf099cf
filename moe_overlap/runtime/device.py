"""Facts of the CUDA devices, queried once per device."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    idx = torch.device(device).index
    return _num_sms(torch.cuda.current_device() if idx is None else idx)
