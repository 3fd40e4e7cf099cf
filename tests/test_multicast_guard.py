"""The NVLink multicast guard: ``require_multicast`` refuses unless multicast is explicitly allowed
AND available; every variable our machines set, or no CUDA, means unavailable. No CuTe DSL needed.
Also: nothing in the package calls cuMulticastCreate."""
import pathlib
import re

import pytest

from moe_overlap.runtime.multicast import (ALLOW_ENV, MULTICAST_DISABLERS,
                                          multicast_unavailable_reason, require_multicast)

ALL_VARS = [name for name, _ in MULTICAST_DISABLERS] + [ALLOW_ENV]


@pytest.fixture
def clean_env(monkeypatch):
    for v in ALL_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_refused_unless_explicitly_allowed(clean_env):
    with pytest.raises(RuntimeError, match="switch.*refuses.*not explicitly allowed"):
        require_multicast()
    with pytest.raises(RuntimeError, match="not explicitly allowed"):
        require_multicast(allow=False)
    clean_env.setenv(ALLOW_ENV, "0")
    assert "not explicitly allowed" in multicast_unavailable_reason()


@pytest.mark.parametrize("name,value", [("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
                                        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                                        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "true")])
def test_each_disabling_variable_refuses(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(RuntimeError, match=f"disabled in this environment \\({name}={value}\\)"):
        require_multicast(allow=True)
    clean_env.setenv(ALLOW_ENV, "1")
    with pytest.raises(RuntimeError, match=name):
        require_multicast()


def test_no_cuda_is_unavailable(clean_env):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        require_multicast(allow=True)


def test_our_machines_refuse_as_configured(monkeypatch):
    """The shared machines' settings: refused even when explicitly allowed."""
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv(ALLOW_ENV, "1")
    with pytest.raises(RuntimeError, match="Use the 'unicast' backend"):
        require_multicast()


def test_band_allreduce_switch_refuses_before_any_work(monkeypatch):
    from moe_overlap.ffn.band_allreduce import BandAllReduce
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with pytest.raises(RuntimeError, match="refuses"):
        BandAllReduce(128, 64, backend="switch")
    with pytest.raises(ValueError, match="multiple of 4"):
        BandAllReduce(128, 63)
    with pytest.raises(ValueError, match="backend"):
        BandAllReduce(128, 64, backend="nvls")
    with pytest.raises(ValueError, match="ready_rows=48 must be a positive multiple of "
                                         "band_rows=32"):
        BandAllReduce(128, 64, band_rows=32, ready_rows=48)


def test_nothing_calls_cu_multicast_create():
    root = pathlib.Path(__file__).resolve().parents[1]
    pat = re.compile(r"cuMulticast(Create|BindMem|BindAddr|AddDevice)\s*\(")
    offenders = [str(p) for d in ("moe_overlap", "bench") for p in (root / d).rglob("*.py")
                 if pat.search(p.read_text())]
    assert not offenders, offenders
