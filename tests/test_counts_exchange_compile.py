"""Compile-only checks of the device counts exchange (combine/counts_exchange.py) for sm_90a (no
GPU needed): the post and gather kernels compile for both transports at several world sizes,
and their PTX carries the ordering the protocol relies on. nvlink post: the error word read
before any store, every row store before the CTA barrier, then per destination
fence.acq_rel.sys and st.release.sys of the flag, and nothing after the flags. nvshmem post: the
error word first, then only NVSHMEM's put-with-signal per destination and a quiet (no direct
peer store, no release). gather (either transport): a bounded ld.acquire.sys wait
(%globaltimer), the peer error word polled with ld.relaxed.sys, fence.acq_rel.sys after the
acquire, a barrier, then the rows with L2-only loads, and the epoch stored after a final
barrier. No stack arrays."""
import os
import re

import pytest

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx  # noqa: E402
from test_dispatch_overlap_compile import _callees  # noqa: E402


def _entries(W, threads, transport="nvlink"):
    from moe_overlap.combine.counts_exchange import (build_counts_exchange,
                                                     counts_exchange_example_args)
    ptx = compile_ptx(build_counts_exchange(W, threads, transport),
                      *counts_exchange_example_args())
    parts = {}
    for m in re.finditer(r"\.entry\s+(\w+)", ptx):
        body = ptx[m.end():]
        body = body[:body.index("\n}\n")]  # the kernel, not the functions linked after it
        parts["post" if "post_kernel" in m.group(1) else "gather"] = body
    assert set(parts) == {"post", "gather"}
    return parts


def _check_gather(g):
    i_acq = g.index("ld.acquire.sys.global.s64")  # the source's flag
    assert "%globaltimer" in g  # bounded
    assert "ld.relaxed.sys.global.s64" in g  # the source's error word, polled
    assert i_acq < g.index("fence.acq_rel.sys", i_acq)  # the rows after the acquire
    i_rows = g.index("ld.global.cg.s64")  # L2 only: the peers wrote the table
    assert g.rindex("ld.acquire.sys.global.s64") < g.rindex("bar.sync", 0, i_rows) < i_rows
    assert g.rfind("ld.global.cg.s64") < g.rindex("bar.sync")  # every row read, then the epoch
    assert g.rindex("st.global.s64") > g.rindex("bar.sync")
    assert "st.release" not in g and not re.search(r"\sred\.", g)  # the gather releases nothing
    assert ".local" not in g and not re.search(r"\bcall", g)


@pytest.mark.parametrize("W,threads", [(1, 32), (2, 256), (4, 64), (8, 256), (64, 32)])
def test_nvlink_flags_are_released_after_the_rows(W, threads):
    parts = _entries(W, threads)
    post = parts["post"]
    i_err = post.index("ld.relaxed.gpu.global.s64")  # the error word, first
    stores = [m.start() for m in re.finditer(r"st\.global\.s64", post)]
    flags = [m.start() for m in re.finditer(r"st\.release\.sys\.global\.s64", post)]
    assert stores and flags and i_err < stores[0]
    i_bar = post.index("bar.sync", stores[-1])  # every row store, then the barrier
    assert all(s < i_bar for s in stores)
    for f in flags:  # each flag: after the barrier, a sys-scope fence before it
        assert i_bar < post.rindex("fence.acq_rel.sys", 0, f) < f
    assert "ld.acquire" not in post and not re.search(r"\sred\.", post)  # the post never waits
    assert ".local" not in post and not re.search(r"\bcall", post)
    _check_gather(parts["gather"])


@pytest.mark.parametrize("W", [2, 4, 8])
def test_nvshmem_posts_rows_with_their_signal(W):
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    import nvshmem.core
    import torch
    nvshmem.core.find_device_bitcode_library(arch="90")  # installed without it: an error
    from moe_overlap.combine.consumer import use_sm90_nvshmem_bitcode
    if not torch.cuda.is_available():  # as CountsExchange.compile: no GPU to pick the bitcode
        use_sm90_nvshmem_bitcode()
    parts = _entries(W, 256, "nvshmem")
    post = parts["post"]
    calls = _callees(post)
    kinds = ["put_signal" if "put_signal_nbi_block" in n else
             "quiet" if "transfer_quiet" in n else n for _, n in calls]
    assert set(kinds) == {"put_signal", "quiet"}, kinds  # nothing else is called
    assert kinds[-1] == "quiet" and "quiet" not in kinds[:-1]
    assert post.index("ld.relaxed.gpu.global.s64") < calls[0][0]  # the error word first
    assert "st.global" not in post and "st.release" not in post
    assert not re.search(r"\sred\.", post)
    assert ".local" not in post
    _check_gather(parts["gather"])
