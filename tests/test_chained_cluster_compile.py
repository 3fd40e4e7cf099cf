"""Compile-only checks (sm_90a, no GPU) of the chained FFN kernel's 2-CTA cluster variant
(``ChainedFFNCompute(cluster=2)``): the dense kernel's protocol (tests/test_chained_ffn_compile.py
``_check_protocol``: WGMMAs, bounded acquire waits each followed by a proxy fence, the counter
releases after wait_group 0, the band flag), the weight tiles loaded as TMA multicasts while x and
the H ring stay per-CTA loads, the cluster mailbox in distributed shared memory (mapa, four
st.shared::cluster words per post, release.cluster remote arrives, acquire.cluster waits), one
more bounded wait per side of the mailbox (its error records), the closing cluster barrier, and
no local-memory spills in the SASS.
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
    dense_loads = re.findall(r"^\s*cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", _body(dense),
                             re.M)
    # as many TMA loads as the dense kernel: its weight loads became the multicasts
    assert len(mcast) + len(plain) == len(dense_loads) and len(plain) < len(mcast)
    # the cluster mailbox: the leader posts four words to the peer's slot, then a remote
    # release.cluster arrive (full); the peer forwards its readers' release (empty)
    assert re.search(r"mapa\.shared::cluster\.u32", body)
    assert len(re.findall(r"st\.shared::cluster\.s32", body)) == 8  # fetch inlined twice
    # (the leader's post at both fetch sites, the peer's forward only in the loop: the first
    # fetch, n = 0, has no earlier tile to forward)
    assert len(re.findall(r"mbarrier\.arrive\.release\.cluster\.shared::cluster\.b64", body)) == 3
    assert re.search(r"mbarrier\.try_wait\.parity\.acquire\.cluster\.shared::cta\.b64", body)
    # the consumers release each stage to both CTAs (the base's cluster-aware empty arrive)
    assert re.search(r"mbarrier\.arrive\.shared::cluster\.b64", body)
    # error records: the two counter waits, and the mailbox's bounded wait on each side
    # (leader: slot free in both CTAs; peer: the leader's post) at both fetch sites
    assert len(re.findall(r"atom\.relaxed\.gpu\.global\.cas\.b64", body)) == 6
    # the closing cluster barrier (no CTA leaves while its peer can still reach its smem)
    assert re.search(r"barrier\.cluster\.arrive;\s*\n\s*barrier\.cluster\.wait;", body)


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS)
def test_cluster_sass_no_spills(mod, P, hidden, N, act1, has_b1):
    _, cubin = _compiled(mod, P, hidden, N, act1, has_b1)
    sass = sass_of(cubin, require_nvdisasm())
    assert re.search(r"\bHGMMA\.64x256x16", sass), "no 64x256 HGMMA in the SASS"
    assert re.search(r"UTMALDG[^\n]*MULTICAST", sass), "no multicast TMA load in the SASS"
    spills = re.findall(r"\b(STL|LDL)\b", sass)
    assert not spills, f"{len(spills)} local-memory spill instructions"


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
    assert "peer to free" in msg0
