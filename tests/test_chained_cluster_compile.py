"""Compile-only checks (sm_90a, no GPU) of the chained FFN kernel's 2-CTA cluster variant
(``ChainedFFNCompute(cluster=2)``): the dense kernel's protocol (tests/test_chained_ffn_compile.py
``_check_protocol``: WGMMAs, bounded acquire waits each followed by a proxy fence, the counter
releases after wait_group 0, the band flag), the weight tiles loaded as TMA multicasts while x and
the H ring stay per-CTA loads, the cluster mailbox in distributed shared memory (mapa, four
st.shared::cluster words per post into the peer's inbox, release.cluster remote arrives,
acquire.cluster waits), the spin loops of the PTX (every operand-ring wait and every mailbox wait
across the cluster reads the global timer and the error word, the waits inside a CTA do not, and
the pipeline's own unbounded wait is gone), the error records, the closing cluster barrier, no
local-memory spills in the SASS, and the private fault builds of the GPU fault tests.
"""
import os
import re

import pytest

from conftest import chained_launch_args
from moe_overlap.kernels.compile import kept_cubin, kept_ptx, require_nvdisasm, sass_of

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.compile

CONFIGS = [  # (P, hidden, N, act1, b1 given)
    (256, 512, 512, "gelu", True),
    (4096, 7168, 4096, "silu", False),
]
_CACHE = {}


@pytest.fixture(scope="module")
def mod():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import cutlass.cute  # noqa: F401
    from moe_overlap.ffn import compute_chained
    return compute_chained


def _compiled(mod, P, hidden, N, act1, has_b1, cluster=2):
    key = (P, hidden, N, act1, has_b1, cluster)
    if key not in _CACHE:
        fn = mod.ChainedFFNCompute(cluster=cluster).compile(P, hidden, N, act1=act1,
                                                            has_b1=has_b1, keep_ptx=True)
        _CACHE[key] = (kept_ptx(fn), kept_cubin(fn))
    return _CACHE[key]


def _body(ptx):
    return ptx.split(".entry", 1)[1]


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS)
def test_cluster_ptx_protocol_multicast_and_mailbox(mod, P, hidden, N, act1, has_b1):
    from test_chained_ffn_compile import _check_protocol
    ptx, _ = _compiled(mod, P, hidden, N, act1, has_b1)
    _check_protocol(ptx)
    body = _body(ptx)
    loads = re.findall(r"^\s*cp\.async\.bulk\.tensor\.2d\.shared::(?:cta|cluster)\.global[^\n]*",
                       body, re.M)
    mcast = [ln for ln in loads if ".multicast::cluster" in ln]
    plain = [ln for ln in loads if ".multicast::cluster" not in ln]
    # W1 and W2 loads multicast (each CTA its half), the x and H (A) loads per CTA
    assert mcast and plain, (len(mcast), len(plain))
    dense, _ = _compiled(mod, P, hidden, N, act1, has_b1, cluster=1)
    assert ".multicast::cluster" not in _body(dense)
    dense_loads = re.findall(r"^\s*cp\.async\.bulk\.tensor\.2d\.shared::cta\.global[^\n]*",
                             _body(dense), re.M)
    # the dense kernel's weight loads became the multicasts: the A tile (x rows or the H
    # block, into sA at offset 1024) per CTA, every weight load multicast, in the dense ratio
    dense_a = [ln for ln in dense_loads if "+1024]" in ln]
    assert all("+1024]" in ln for ln in plain) and not any("+1024]" in ln for ln in mcast)
    assert len(mcast) * len(dense_a) == len(plain) * (len(dense_loads) - len(dense_a))
    # the cluster mailbox: the leader posts four words to the peer's inbox, then a remote
    # release.cluster arrive (inbox_full); the peer forwards that it read the inbox
    # (inbox_free), at both fetch sites (fetch inlined before and inside the tile loop)
    assert re.search(r"mapa\.shared::cluster\.u32", body)
    assert len(re.findall(r"st\.shared::cluster\.s32", body)) == 8
    assert len(re.findall(r"mbarrier\.arrive\.release\.cluster\.shared::cluster\.b64", body)) == 4
    assert re.search(r"mbarrier\.try_wait\.parity\.acquire\.cluster\.shared::cta\.b64", body)
    # the consumers release each stage to both CTAs (the base's cluster-aware empty arrive)
    assert re.search(r"mbarrier\.arrive\.shared::cluster\.b64", body)
    # error records: the two counter waits, the mailbox's bounded wait on each side (leader: the
    # peer's forward; peer: the leader's post) at both fetch sites, and the seven operand-ring
    # waits (the TMA warp's acquire, the consumers' two full waits of mma_tile, the tail's one
    # per stage: 4)
    stages = mod.ChainedFFNCompute(cluster=2).stages
    assert stages == 4
    assert len(re.findall(r"atom\.relaxed\.gpu\.global\.cas\.b64", body)) == 2 + 4 + 3 + stages
    # the closing cluster barrier (no CTA leaves while its peer can still reach its smem)
    assert re.search(r"barrier\.cluster\.arrive;\s*\n\s*barrier\.cluster\.wait;", body)


def spin_loops(ptx):
    """The innermost loops of the kernel body (a backward branch to a label) that contain an
    mbarrier try_wait, each as (scope: "cta" | "cluster", reads the global timer, loads the
    error word with ld.relaxed.gpu): what each spin-wait loop of the PTX does."""
    lines = _body(ptx).splitlines()
    label_at = {m.group(1): i for i, ln in enumerate(lines)
                if (m := re.match(r"^(\$L__BB\d+_\d+):", ln))}
    loops = []
    for j, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)
        if m and m.group(1) in label_at and label_at[m.group(1)] < j:
            loops.append((label_at[m.group(1)], j))
    inner = [(i, j) for i, j in loops
             if not any(i <= a and b <= j and (a, b) != (i, j) for a, b in loops)]
    out = []
    for i, j in inner:
        text = "\n".join(lines[i:j + 1])
        waits = re.findall(r"mbarrier\.try_wait\.parity(\.acquire\.cluster)?\.shared::cta\.b64",
                           text)
        if waits:
            assert len(set(waits)) == 1, text
            out.append(("cluster" if waits[0] else "cta", "%globaltimer" in text,
                        "ld.relaxed.gpu.global.s64" in text))
    return out


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS)
def test_cluster_ptx_every_cross_cta_wait_is_bounded(mod, P, hidden, N, act1, has_b1):
    """Every spin on an mbarrier whose far side is the other CTA reads the global timer and the
    error word inside its loop: the operand ring's seven (CTA-scope try_wait, as the base
    pipeline's) and the mailbox's four (acquire.cluster); the six waits inside one CTA (the
    readers' four, the TMA warp's two for its readers) are the plain spins of cluster 1; and
    the base pipeline's own wait loop (``try_wait.parity.shared.b64 ..., 10000000``, unbounded)
    is gone, while the dense kernel keeps it."""
    ptx, _ = _compiled(mod, P, hidden, N, act1, has_b1)
    loops = spin_loops(ptx)
    stages = mod.ChainedFFNCompute(cluster=2).stages
    assert loops.count(("cta", True, True)) == 3 + stages, loops
    assert loops.count(("cluster", True, True)) == 4, loops
    assert loops.count(("cta", False, False)) == 6, loops
    assert len(loops) == 3 + stages + 4 + 6, loops
    pipeline_wait = r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[%r\d+\], %r\d+, 10000000"
    assert not re.search(pipeline_wait, _body(ptx))
    dense, _ = _compiled(mod, P, hidden, N, act1, has_b1, cluster=1)
    assert re.search(pipeline_wait, _body(dense))
    assert spin_loops(dense).count(("cta", False, False)) == 6
    assert not [lp for lp in spin_loops(dense) if lp[1]]
    # the TMA warp's one decision per stage (a stage it gave up on, or whose previous fill
    # never completed, is neither armed nor loaded)
    assert len(re.findall(r"vote\.sync\.all\.pred", _body(ptx))) == 1
    assert len(re.findall(r"mbarrier\.test_wait\.parity\.shared::cta\.b64", _body(ptx))) == 1


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS)
def test_cluster_sass_no_spills(mod, P, hidden, N, act1, has_b1):
    ptx, cubin = _compiled(mod, P, hidden, N, act1, has_b1)
    sass = sass_of(cubin, require_nvdisasm())
    assert re.search(r"\bHGMMA\.64x256x16", sass), "no 64x256 HGMMA in the SASS"
    assert re.search(r"UTMALDG[^\n]*MULTICAST", sass), "no multicast TMA load in the SASS"
    spills = re.findall(r"\b(STL|LDL)\b", sass)
    assert not spills, f"{len(spills)} local-memory spill instructions"
    # every global-timer read of the bounded waits survived into the SASS
    timers = len(re.findall(r"%globaltimer", _body(ptx)))
    assert len(re.findall(r"SR_GLOBALTIMER", sass)) == timers >= 2 * (3 + 4 + 4)


@pytest.mark.parametrize("fault", [("stall_leader", 2), ("stop_peer", 2)])
def test_cluster_fault_builds_compile(mod, fault):
    """The private fault builds of tests/test_chained_cluster_faults_gpu.py compile for sm_90a:
    the stall spins on the global timer before the leader's fetch; the stopped peer keeps every
    wait and error record (the fault gives up at run time, on cluster 0's tile only)."""
    fn = mod.ChainedFFNCompute(cluster=2, _test_cluster_fault=fault).compile(
        256, 512, 512, act1="gelu", has_b1=True, keep_ptx=True)
    body = _body(kept_ptx(fn))
    base = _body(_compiled(mod, 256, 512, 512, "gelu", True)[0])
    timers = len(re.findall(r"%globaltimer", body)) - len(re.findall(r"%globaltimer", base))
    assert timers == (2 if fault[0] == "stall_leader" else 0), timers
    assert len(re.findall(r"atom\.relaxed\.gpu\.global\.cas\.b64", body)) == \
        len(re.findall(r"atom\.relaxed\.gpu\.global\.cas\.b64", base))


def test_cluster_fault_switch_is_checked():
    from moe_overlap.ffn.compute_chained import ChainedFFNCompute
    for bad in [("stall_leader", 0), ("stop", 2), ("stop_peer",), ["stop_peer", 2],
                ("stop_peer", True)]:
        with pytest.raises(ValueError):
            ChainedFFNCompute(cluster=2, _test_cluster_fault=bad)
    with pytest.raises(ValueError):
        ChainedFFNCompute(cluster=1, _test_cluster_fault=("stop_peer", 2))
    a = ChainedFFNCompute(cluster=2)
    b = ChainedFFNCompute(cluster=2, _test_cluster_fault=("stop_peer", 2))
    assert a._key(256, 512, 512, "gelu", True) != b._key(256, 512, 512, "gelu", True)


def test_cluster_launch_path_compiles_from_torch_tensors(mod):
    """__call__'s argument conversion with the pair table (M with an odd block count)."""
    from cutlass.runtime import make_fake_stream
    c = mod.ChainedFFNCompute(cluster=2, group=2)
    M, P, hidden, N = 300, 256, 512, 512
    grid = c.grid(M, hidden, N, sms=132)
    assert grid % 2 == 0
    s = c.schedule(M, P, hidden, N, grid)
    assert isinstance(s, mod.PairedChainedSchedule) and s.blocks == 3 and s.pair_blocks == 2
    assert s.grid == grid
    args, ints = chained_launch_args(c, s, M, P, hidden, N)
    fn = c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu", True)
    assert fn is c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu", True)
    dense = mod.ChainedFFNCompute(group=2)
    assert dense._key(P, hidden, N, "relu", True) != c._key(P, hidden, N, "relu", True)


def test_describe_mailbox_timeout():
    from moe_overlap.ffn.chained_schedule import ERR_MAILBOX_TIMEOUT
    from moe_overlap.ffn.compute_chained import describe_chained_error
    msg = describe_chained_error([ERR_MAILBOX_TIMEOUT, 1, 17, 1, 0, 0, 2_500_000_000, 0])
    assert "cluster rank 1" in msg and "tile 17" in msg and "slot 1" in msg
    assert "leader to post" in msg
    msg0 = describe_chained_error([ERR_MAILBOX_TIMEOUT, 0, 5, 0, 0, 1, 2_000_000_000, 0])
    assert "peer's TMA warp to read" in msg0 and "forward" in msg0


def test_describe_ring_timeout():
    """The ring wait's record (primitives.record_error's words: rank = cluster rank, index =
    stage, band = side, observed = phase parity, expected = block index) names all of them."""
    from moe_overlap.ffn.chained_schedule import (ERR_RING_TIMEOUT, RING_ACQUIRE, RING_FULL,
                                                  RING_TAIL)
    from moe_overlap.ffn.compute_chained import describe_chained_error
    msg = describe_chained_error([ERR_RING_TIMEOUT, 0, 3, RING_FULL, 1, 6, 2_000_000_000, 0])
    assert "operand ring" in msg and "cluster rank 0" in msg and "stage 3" in msg
    assert "phase parity 1" in msg and "consumer side" in msg and "block 6, cluster 3" in msg
    msg = describe_chained_error([ERR_RING_TIMEOUT, 1, 0, RING_ACQUIRE, 0, 1, 10 ** 9, 0])
    assert "cluster rank 1" in msg and "producer side" in msg and "producer_acquire" in msg
    msg = describe_chained_error([ERR_RING_TIMEOUT, 1, 2, RING_TAIL, 0, 1, 10 ** 9, 0])
    assert "producer_tail" in msg and "stage 2" in msg
