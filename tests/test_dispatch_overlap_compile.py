"""Compile-only checks of the overlapped dispatch's kernels for sm_90a (no GPU needed): the send
kernel (combine/dispatch_send.py) and the owner's wait + expand (combine/dispatch_expand.py)
compile at several world sizes and top-k, and their PTX carries the ordering the protocol relies
on: the sender reads its error word before any store, stores the call tag (st.relaxed.sys) and
then releases the marker (fence.acq_rel.sys, red.release.sys.add) after its data; the owner
waits with ld.acquire.sys bounded by %globaltimer, polls the peer's error word and reads the tag
with ld.relaxed.sys, and reads the slot with L2-only loads. No stack arrays."""
import os

import pytest

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx as _ptx, ptx_body  # noqa: E402


@pytest.mark.parametrize("W,topk,threads", [(2, 2, 256), (4, 8, 256), (8, 8, 128), (64, 4, 256)])
def test_send_compiles_with_its_release_after_the_data(W, topk, threads):
    from moe_overlap.combine.dispatch_send import build_dispatch_send, send_example_args
    body = ptx_body(_ptx(build_dispatch_send(W, topk, threads), *send_example_args()))
    assert "vote.sync.ballot.b32" in body  # per-destination compaction by ballots
    i_err = body.index("ld.relaxed.gpu.global.s64")  # the error word, first
    i_data = body.index("st.global.v4.u32")  # token rows to the owner's slot
    i_tag = body.index("st.relaxed.sys.global.s64")  # call tag in the owner's block
    i_fence = body.rindex("fence.acq_rel.sys")
    i_mark = body.index("red.release.sys.global.add.u64")  # the arrival marker
    assert i_err < i_data < i_tag < i_fence < i_mark
    assert body.count("red.release.sys.global.add.u64") == 1
    assert "ld.acquire" not in body  # the sender never waits
    assert ".local" not in body


@pytest.mark.parametrize("W,topk", [(2, 2), (4, 8), (8, 8), (64, 1)])
def test_expand_compiles_with_a_bounded_sys_acquire_wait(W, topk):
    from moe_overlap.combine.dispatch_expand import build_dispatch_expand, expand_example_args
    ptx = _ptx(build_dispatch_expand(W, topk), *expand_example_args())
    entries = ptx.split(".entry")[1:]
    assert len(entries) == 2  # wait kernel, expand kernel
    wait = next(e for e in entries if "ld.acquire" in e)
    expand = next(e for e in entries if e is not wait)
    assert "ld.acquire.sys.global.s64" in wait  # the source's arrival counter
    assert "%globaltimer" in wait  # bounded
    assert wait.count("ld.relaxed.sys.global.s64") >= 2  # peer error word poll + call tag
    assert wait.index("ld.acquire.sys.global.s64") < wait.rindex("fence.acq_rel.sys")
    assert "ld.global.cg.v4.u32" in expand  # slot rows: L2 only (peers wrote them)
    assert "ld.global.cg.s32" in expand  # ids and counts of the slot, likewise
    assert "ld.acquire" not in expand and "red.release" not in expand  # ordered by the boundary
    for e in entries:
        assert ".local" not in e


@pytest.mark.parametrize("W,topk", [(2, 2), (8, 8)])
def test_expand_signal_arrival_releases_the_flags_after_the_rows(W, topk):
    """signal_arrival: every row / gap store of an item, then bar.sync, then thread 0's
    fence.acq_rel.gpu and atom.acq_rel.gpu add on the expert's count, then (the completing
    item) st.release.gpu of the band flags; the default expand has none of it."""
    from moe_overlap.combine.dispatch_expand import build_dispatch_expand, expand_example_args
    ptx = _ptx(build_dispatch_expand(W, topk, signal_arrival=True), *expand_example_args(True))
    expand = next(e for e in ptx.split(".entry")[1:] if "ld.acquire" not in e)
    i_atom = expand.index("atom.acq_rel.gpu.global.add.s32")
    assert expand.count("atom.acq_rel.gpu.global.add.s32") == 1
    assert expand.rindex("st.global.v4.u32") < expand.rindex("bar.sync", 0, i_atom)  # rows
    assert expand.rindex("bar.sync", 0, i_atom) < expand.rindex("fence.acq_rel.gpu", 0, i_atom)
    i_flag = expand.index("st.release.gpu.global.s32")  # band_arrived[b] = epoch
    assert i_atom < i_flag
    assert "st.global.v4.u32" not in expand[i_atom:]  # no row store after the count
    assert "ld.acquire" not in expand and ".local" not in expand
    plain = _ptx(build_dispatch_expand(W, topk), *expand_example_args())
    assert "atom.acq_rel" not in plain and "st.release" not in plain
