"""Compile-only (sm_90a, no GPU) checks of the fault handling in the combine kernels and the band
all-reduce (issue 21): the PTX carries the checks the design relies on, in the order it needs.

- consumer: reads the error word before anything else and skips everything when it is set;
  writes the epoch tag (st.relaxed.sys) before the call marker (red.release.sys, same thread);
  bounds-checks plan entries (64-bit range compares) before any store;
- scale: two kernels, the arrival wait on one warp per source (the only sys-scope acquire),
  the scale kernel without any spin, with the NaN fill and per-row bounds checks;
- band all-reduce: its cubin's registers give one CTA of 1024 threads per SM.
"""
import os
import re

import pytest

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx as _ptx  # noqa: E402


def _entries(ptx):
    """{entry name: body} of every kernel in the PTX."""
    parts = re.split(r"\.entry\s+", ptx)[1:]
    return {p.split("(", 1)[0].strip(): p for p in parts}


@pytest.fixture(scope="module")
def consumer_ptx():
    from moe_overlap.combine.consumer import build_consumer, consumer_example_args
    return _ptx(build_consumer("nvlink"), *consumer_example_args()).split(".entry", 1)[1]


def test_consumer_checks_error_word_first(consumer_ptx):
    body = consumer_ptx
    i_err = body.index("ld.relaxed.gpu.global.s64")  # the error word
    # before the call marker, any band wait and any row store
    assert i_err < body.index("red.release.sys.global.add.u64")
    assert i_err < body.index("ld.acquire.gpu.global.s32")
    assert i_err < body.index("st.global.v4.u32")


def test_consumer_epoch_tag_before_marker(consumer_ptx):
    body = consumer_ptx
    i_tag = body.index("st.relaxed.sys.global.s64")
    assert i_tag < body.index("red.release.sys.global.add.u64")
    assert body.count("st.relaxed.sys.global.s64") == 1  # one tag per (call, destination)


def test_consumer_bounds_checks_before_stores(consumer_ptx):
    body = consumer_ptx
    # range checks: lo <= v (setp.ge.s64) and v < hi (setp.lt.and.s64)
    assert body.count("setp.lt.and.s64") >= 8
    first_check = body.index("setp.lt.and.s64")
    assert first_check < body.index("st.global.v4.u32")  # no row store before a check
    # ERR_PLAN_BOUNDS recorded through the first-writer-wins CAS
    assert "atom.relaxed.gpu.global.cas.b64" in body


@pytest.mark.parametrize("copy,local_copy", [("tma", False), ("tma", True), ("ldst", False)])
def test_consumer_variants_keep_the_checks(copy, local_copy):
    from moe_overlap.combine.consumer import build_consumer, consumer_example_args
    body = _ptx(build_consumer("nvlink", copy=copy, local_copy=local_copy),
                *consumer_example_args()).split(".entry", 1)[1]
    assert body.index("ld.relaxed.gpu.global.s64") < body.index("red.release.sys.global.add")
    assert body.index("st.relaxed.sys.global.s64") < body.index("red.release.sys.global.add")
    assert "setp.lt.and.s64" in body


def test_consumer_nvshmem_epoch_tag_before_marker():
    """nvshmem transport: after the error word is read, the epoch tag (a signal op), an NVSHMEM
    fence, then the call marker (a second signal op), all before the first row is put."""
    from conftest import nvshmem_calls, nvshmem_consumer_body
    body = nvshmem_consumer_body()
    calls = nvshmem_calls(body)
    assert [k for _, k in calls][:4] == ["signal", "fence", "signal", "put"]  # tag, marker
    assert body.index("ld.relaxed.gpu.global.s64") < calls[0][0]


@pytest.mark.parametrize("topk,y_src,unroll", [(2, False, 1), (8, True, 1), (4, True, 2)])
def test_scale_wait_is_its_own_small_kernel(topk, y_src, unroll):
    from moe_overlap.combine.scale import BF16X2_NAN, WAIT_THREADS, build_scale, \
        scale_example_args
    ptx = _ptx(build_scale(topk, y_src=y_src, unroll=unroll), *scale_example_args())
    ents = _entries(ptx)
    assert len(ents) == 2, list(ents)
    wait = next(b for n, b in ents.items() if "wait_kernel" in n)
    work = next(b for n, b in ents.items() if "scale_kernel" in n)
    # only the one-warp wait kernel spins on the peers' counters
    assert f".reqntid {WAIT_THREADS}" in wait or f".maxntid {WAIT_THREADS}" in wait
    assert "ld.acquire.sys.global.s64" in wait and "%globaltimer" in wait
    assert "ld.acquire.sys" not in work and "%globaltimer" not in work
    # epoch tag read and compared, then a sys fence before the kernel ends
    assert "ld.relaxed.sys.global.s64" in wait and "fence.acq_rel.sys" in wait
    # the scale: the error word read, NaN rows, row bounds
    assert "ld.relaxed.gpu.global.s64" in work
    assert str(BF16X2_NAN) in work or hex(BF16X2_NAN)[2:].upper() in work.upper()
    assert work.count("setp.lt.and.s64") >= topk * unroll
    i_err = work.index("ld.relaxed.gpu.global.s64")
    assert i_err < work.index("ld.global.cg.v4.u32")  # no slot read before the error check
    assert ".local" not in work


def test_band_allreduce_registers_allow_coresidency():
    from moe_overlap.ffn import band_allreduce as B
    c = B.compile_band_allreduce(8, "unicast", keep=True)
    per_sm = B.coresident_ctas_per_sm(c, B.DEFAULT_THREADS)
    assert per_sm >= 1  # every CTA of the default grid (<= SMs) can be resident
    from moe_overlap.runtime.device import cubin_resources
    (regs, _), = cubin_resources(c.__cubin__).values()
    assert 0 < regs <= 65536 // B.DEFAULT_THREADS


def _loops(body):
    """[(label, loop body)] of every backward branch of the PTX ``body`` (label ... bra label)."""
    out = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):", body, re.M):
        label = m.group(1)
        back = re.search(r"bra(?:\.uni)?\s+" + re.escape(label) + r";", body[m.end():])
        if back:
            out.append((label, body[m.end():m.end() + back.end()]))
    return out


@pytest.mark.parametrize("topk,y_src", [(8, True), (2, False)])
def test_scale_wait_polls_the_source_error_code_bounded(topk, y_src):
    """The arrival wait's spin loads the source's counter (ld.acquire.sys) AND its error code
    (ld.relaxed.sys, the peer's symmetric word) in the same loop, which is bounded by
    %globaltimer; a set code records ERR_PEER_ERROR through the first-writer-wins CAS."""
    from moe_overlap.combine.scale import build_scale, scale_example_args
    from moe_overlap.kernels.errors import ERR_PEER_ERROR, ERR_SCALE_TIMEOUT
    ents = _entries(_ptx(build_scale(topk, y_src=y_src), *scale_example_args()))
    wait = next(b for n, b in ents.items() if "wait_kernel" in n)
    spins = [b for _, b in _loops(wait) if "ld.acquire.sys.global.s64" in b]
    assert len(spins) == 1, spins  # one spin: counter and peer code together
    spin = spins[0]
    assert "ld.relaxed.sys.global.s64" in spin  # the peer's code, strong sys-scope load
    assert "%globaltimer" in spin and "setp.gt.s64" in spin  # bounded by the timeout
    cas = re.findall(r"atom\.relaxed\.gpu\.global\.cas\.b64 %rd\d+, \[%rd\d+\], 0, (\d+);",
                     wait)
    assert str(ERR_PEER_ERROR) in cas and str(ERR_SCALE_TIMEOUT) in cas
