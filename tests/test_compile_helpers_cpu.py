"""The compile helpers the compile-only tests use fail loudly when the DSL keeps nothing."""
import types

import pytest

from moe_overlap.kernels import compile as kc


def test_kept_ptx_and_cubin_raise_when_the_dsl_kept_nothing():
    for empty in (types.SimpleNamespace(), types.SimpleNamespace(__ptx__="", __cubin__=b"")):
        with pytest.raises(RuntimeError, match="no PTX"):
            kc.kept_ptx(empty)
        with pytest.raises(RuntimeError, match="no cubin"):
            kc.kept_cubin(empty)
    full = types.SimpleNamespace(__ptx__=".entry k {}", __cubin__=b"\x7fELF")
    assert kc.kept_ptx(full) == ".entry k {}" and kc.kept_cubin(full) == b"\x7fELF"


def test_require_nvdisasm_raises_without_one(monkeypatch):
    monkeypatch.setattr(kc, "find_nvdisasm", lambda: None)
    with pytest.raises(RuntimeError, match="nvdisasm"):
        kc.require_nvdisasm()
    monkeypatch.setattr(kc, "find_nvdisasm", lambda: "/x/nvdisasm")
    assert kc.require_nvdisasm() == "/x/nvdisasm"
