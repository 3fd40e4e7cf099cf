"""Compile-only checks of the overlapped dispatch's kernels for sm_90a (no GPU needed): the send
kernel (combine/dispatch_send.py) and the owner's wait + expand (combine/dispatch_expand.py)
compile at several world sizes and top-k, and their PTX carries the ordering the protocol relies
on: the sender reads its error word before any store, stores the call tag (st.relaxed.sys) and
then releases the marker (fence.acq_rel.sys, red.release.sys.add) after its data; the owner
waits with ld.acquire.sys bounded by %globaltimer, polls the peer's error word and reads the tag
with ld.relaxed.sys, and reads the slot with L2-only loads. No stack arrays. The send's nvshmem
transport (W = 2, 4, 8): NVSHMEM puts of the rows and ids, then the count, the tag signal, a
fence and the marker signal, per destination, and a quiet; no direct peer store or release."""
import os
import re

import pytest

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx as _ptx, nvshmem_calls, ptx_body  # noqa: E402


@pytest.mark.parametrize("W,topk,threads", [(2, 2, 256), (4, 8, 256), (8, 8, 128), (64, 4, 256)])
def test_send_compiles_with_its_release_after_the_data(W, topk, threads):
    from moe_overlap.combine.dispatch_send import build_dispatch_send, send_example_args
    body = ptx_body(_ptx(build_dispatch_send(W, topk, threads), *send_example_args()))
    assert "vote.sync.ballot.b32" in body  # per-destination compaction by ballots
    i_err = body.index("ld.relaxed.gpu.global.s64")  # the error word, first
    assert i_err < body.index("st.global.v4.u32")  # before any token row to an owner's slot
    # one marker per destination, after that destination's rows (the compiler may lay the
    # destination loop out more than once): in the text from the previous marker to each
    # marker, the rows, the CTA barrier, the call tag, the fence, in that order
    marks = [m.start() for m in re.finditer(r"red\.release\.sys\.global\.add\.u64", body)]
    assert marks and not re.search(r"\n\s*red\.", body.replace("red.release.sys", ""))
    prev = 0
    for i_mark in marks:
        seg = body[prev:i_mark]
        i_data = seg.rfind("st.global.v4.u32")
        i_bar = seg.rfind("bar.sync")
        i_tag = seg.rfind("st.relaxed.sys.global.s64")
        i_fence = seg.rfind("fence.acq_rel.sys")
        assert -1 < i_data < i_bar < i_tag < i_fence, (i_data, i_bar, i_tag, i_fence)
        prev = i_mark + 1
    assert "ld.acquire" not in body  # the sender never waits
    assert ".local" not in body
    assert not re.search(r"\bcall", body)  # nothing linked in: no NVSHMEM call


def _callees(body: str) -> list[tuple[int, str]]:
    """(offset, callee name) of every call in a PTX body: direct calls by name, indirect ones
    (call %rdN) through the function address a mov.b64 put in that register."""
    addr, out = {}, []
    for m in re.finditer(r"mov\.b64\s+(%rd\d+),\s*([A-Za-z_$][\w$]*);"
                         r"|\bcall(?:\.uni)?\s+(?:\([^)]*\),\s*)?(%rd\d+|[A-Za-z_$][\w$]*)", body):
        if m.group(1):
            addr[m.group(1)] = m.group(2)
        else:
            out.append((m.start(), addr.get(m.group(3), m.group(3))))
    return out


# the send's NVSHMEM calls, by the device function each resolves to (nvshmem4py 0.4)
SEND_CALLS = (("bfloat16_put_nbi_block", "row"), ("int32_put_nbi", "ids"), ("int32_p", "count"),
              ("signal_op", "signal"), ("transfer_fence", "fence"), ("transfer_quiet", "quiet"))


@pytest.mark.parametrize("W", [2, 4, 8])
def test_send_nvshmem_puts_the_data_before_the_tag_fence_and_marker(W):
    """transport="nvshmem": the error word read first; per destination, after the CTA's
    block-scoped row puts and its threads' id puts, the CTA barrier, then thread 0's count (p),
    tag (signal set), fence and marker (signal add), in that order (the compiler may lay the
    destination loop out more than once: checked in the text from one marker to the next); a
    quiet after the last marker; no direct store to a peer and no release of the nvlink
    path."""
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    import nvshmem.core
    import torch
    nvshmem.core.find_device_bitcode_library(arch="90")  # installed without it: an error
    from moe_overlap.combine.consumer import use_sm90_nvshmem_bitcode
    from moe_overlap.combine.dispatch_send import build_dispatch_send, send_example_args
    if not torch.cuda.is_available():  # as DispatchSend.compile: no GPU to pick the bitcode by
        use_sm90_nvshmem_bitcode()
    body = ptx_body(_ptx(build_dispatch_send(W, 4, 256, "nvshmem"), *send_example_args()))
    body = body[:body.index("\n}\n")]  # the kernel, not the NVSHMEM functions linked after it
    calls = [(i, next((k for sub, k in SEND_CALLS if sub in name), name))
             for i, name in _callees(body)]
    kinds = [k for _, k in calls]
    assert set(kinds) <= {k for _, k in SEND_CALLS}, kinds  # nothing else is called
    # the generic finder of the consumer's tests sees the same signals, fence and quiet
    assert [k for _, k in nvshmem_calls(body)] == [k for k in kinds if k not in
                                                   ("row", "ids", "count")]
    assert body.index("ld.relaxed.gpu.global.s64") < calls[0][0]  # the error word first
    assert "vote.sync.ballot.b32" in body
    marks = [i for n, (i, k) in enumerate(calls) if k == "signal" and n and
             calls[n - 1][1] == "fence"]
    assert marks and kinds.count("signal") == 2 * len(marks)  # a tag and a marker each
    prev = 0
    for i_mark in marks:
        seg = [(i, k) for i, k in calls if prev <= i < i_mark]
        last = {k: i for i, k in seg}
        i_bar = body.rindex("bar.sync", prev, last["count"])
        assert "row" in last and "ids" in last, seg
        assert last["row"] < i_bar and last["ids"] < i_bar, seg
        assert [k for _, k in seg[-3:]] == ["count", "signal", "fence"], seg
        # no data put between the barrier and the marker
        assert not [k for i, k in seg if i > i_bar and k in ("row", "ids")], seg
        prev = i_mark + 1
    assert kinds[-1] == "quiet" and calls[-1][0] > marks[-1]
    assert "st.global" not in body and "red.release" not in body and "ld.acquire" not in body
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


def _loads_then_stores(body: str, load: str, unroll: int):
    """The row copy's `unroll` 16-byte loads (PTX `load`) come before any 16-byte store, and
    each loaded vector is stored after the last of them."""
    loads = [m.start() for m in re.finditer(re.escape(load) + r" \{", body)]
    assert unroll >= 2 and len(loads) == unroll
    assert "st.global.v4.u32" not in body[loads[0]:loads[-1]]  # no store between them
    after = body[loads[-1]:]
    for m in re.finditer(re.escape(load) + r" \{(%r\d+),", body):
        assert re.search(rf"st\.global\.v4\.u32 \[[^]]+\], \{{{m.group(1)},", after), m.group(1)


@pytest.mark.parametrize("wait", ["all", "per_source"])
def test_expand_copies_with_its_loads_in_flight_before_their_stores(wait):
    """The row copy issues COPY_UNROLL 16-byte slot loads, then their stores: one load at a
    time would leave it bound by the load latency."""
    from moe_overlap.combine.dispatch_expand import (COPY_UNROLL, build_dispatch_expand,
                                                     expand_example_args)
    ptx = _ptx(build_dispatch_expand(8, 8, wait=wait), *expand_example_args(wait=wait))
    expand = next(e for e in ptx.split(".entry")[1:] if "ld.global.cg.v4.u32" in e)
    _loads_then_stores(expand, "ld.global.cg.v4.u32", COPY_UNROLL)


def test_send_copies_with_its_loads_in_flight_before_their_stores():
    """The nvlink send's row copy likewise: COPY_UNROLL token-row loads, then their stores to
    the owner's slot."""
    from moe_overlap.combine.dispatch_send import (COPY_UNROLL, build_dispatch_send,
                                                   send_example_args)
    body = ptx_body(_ptx(build_dispatch_send(8, 8, 256), *send_example_args()))
    _loads_then_stores(body, "ld.global.v4.u32", COPY_UNROLL)


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


@pytest.mark.parametrize("W,topk,arrival", [(2, 2, False), (2, 2, True), (8, 8, True),
                                            (64, 4, True)])
def test_expand_per_source_waits_per_item_and_releases_its_bands_after_the_rows(W, topk,
                                                                                 arrival):
    """wait='per_source': one kernel. Each item's thread 0 waits (ld.acquire.sys bounded by
    %globaltimer, the peer's error word and the tag by ld.relaxed.sys) then fence.acq_rel.sys,
    and the CTA-wide vote (bar.red) orders it before the CTA's L2-only loads of the slot.
    signal_arrival: the item's row and gap stores, bar.sync, thread 0's fence.acq_rel.gpu, then
    the band flags (st.release.gpu) and the shared bands' writer counts (atom.acq_rel.gpu);
    the finished-CTA count (atom.acq_rel.gpu after a bar.sync and fence) comes last, then the
    error path's NaN stores."""
    from moe_overlap.combine.dispatch_expand import build_dispatch_expand, expand_example_args
    ptx = _ptx(build_dispatch_expand(W, topk, signal_arrival=arrival, wait="per_source"),
               *expand_example_args(arrival, "per_source"))
    entries = ptx.split(".entry")[1:]
    assert len(entries) == 1
    k = entries[0]
    i_acq = k.index("ld.acquire.sys.global.s64")  # the source's arrival counter
    assert "%globaltimer" in k and k.count("ld.relaxed.sys.global.s64") >= 2
    i_load = k.index("ld.global.cg.s32")  # the first slot read (its count word)
    i_vote = k.rindex("bar.red.or.pred", 0, i_load)
    i_fsys = k.rindex("fence.acq_rel.sys", 0, i_vote)
    assert i_acq < i_fsys < i_vote < i_load < k.index("ld.global.cg.v4.u32")  # then its rows
    atoms = [m.start() for m in re.finditer(r"atom\.acq_rel\.gpu\.global\.add\.s32", k)]
    i_done = atoms[-1]  # the finished-CTA count
    assert k.rindex("fence.acq_rel.gpu", 0, i_done) > k.rindex("bar.sync", 0, i_done)
    i_nan = k.rindex("st.global.v4.u32")
    assert i_done < i_nan  # the error path's NaN rows after it
    if arrival:
        flags = [m.start() for m in re.finditer(r"st\.release\.gpu\.global\.s32", k)]
        # (the compiler may duplicate the flag blocks: the count of copies is its choice)
        assert flags and len(atoms) >= 2 and flags[-1] < i_done
        for f in flags:
            i_fgpu = k.rindex("fence.acq_rel.gpu", 0, f)
            i_bar = k.rindex("bar.sync", 0, i_fgpu)
            assert k.rindex("st.global.v4.u32", 0, f) < i_bar < i_fgpu < f
        assert k.rindex("fence.acq_rel.gpu", 0, atoms[0]) > k.rindex("st.global.v4.u32", 0,
                                                                          atoms[0])
        assert "st.global.v4.u32" not in k[flags[0]:i_done]  # no row store among the flags
    else:
        assert "st.release" not in k and len(atoms) == 1
    assert ".local" not in k
