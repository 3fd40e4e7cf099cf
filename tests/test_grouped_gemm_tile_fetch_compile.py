"""GroupedGemm(tile_fetch=...): the option, its host side, and the dynamic kernel compiled for
sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a); the GPU checks are
tests/test_grouped_gemm_tile_fetch_gpu.py.

The default (tile_fetch="static") kernel must not change: its PTX (normalized as
scripts/ptx_fingerprint.py does) is compared with the SHA-256 of the PTX that the commit before
the option (cb699cc) compiled, with the nvidia-cutlass-dsl version they were made with; a kernel
change that is meant to change the default PTX updates STATIC_PTX_SHA256 (and says so in
bench/NOTES.md)."""
import hashlib
import os
import re
import sys

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from moe_overlap.combine.grouped_gemm import TILE_FETCH, GroupedGemm  # noqa: E402
from moe_overlap.combine.options import CombineOptions, producer_gemm_options  # noqa: E402

# ---------------------------------------------------------------- the option (CPU, no CuTe DSL)


def test_check_options_accepts_static_and_dynamic_and_refuses_the_rest():
    assert TILE_FETCH == ("static", "dynamic")
    assert GroupedGemm().tile_fetch == "static"
    for v in TILE_FETCH:
        GroupedGemm.check_options(tile_fetch=v)
        assert GroupedGemm(tile_fetch=v).tile_fetch == v
    for bad in ("auto", "Dynamic", None, 1, True, ""):
        with pytest.raises(ValueError, match="tile_fetch"):
            GroupedGemm.check_options(tile_fetch=bad)
        with pytest.raises(ValueError, match="tile_fetch"):
            GroupedGemm(tile_fetch=bad)


def test_combine_options_pass_tile_fetch_to_the_producer():
    """CombineOptions(gemm_options=...) checks it against the GEMM, producer_gemm_options keeps
    it beside a consumer (where it matters), and a bad value is refused up front."""
    assert CombineOptions(gemm_options={"tile_fetch": "dynamic"}).check_gemm_options(128) == \
        {"tile_fetch": "dynamic"}
    with pytest.raises(ValueError, match="tile_fetch"):
        CombineOptions(gemm_options={"tile_fetch": "atomic"}).check_gemm_options(128)
    opts = producer_gemm_options({"tile_fetch": "dynamic", "cluster_n": 2}, ccta=16)
    assert opts["tile_fetch"] == "dynamic" and opts["cluster_n"] == 2
    assert producer_gemm_options({"tile_fetch": "dynamic"}, ccta=0)["tile_fetch"] == "dynamic"


def test_bench_variant_with_tile_fetch_is_a_gemm_option():
    """bench_producer_models.py --variants cluster_n=2+tile_fetch=dynamic: both go to the
    producer GEMM's options and pass its checks."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import bench_producer_models as B
    vs = B.parse_variants("default,cluster_n=2,cluster_n=2+tile_fetch=dynamic")
    assert [v["name"] for v in vs] == ["default", "cluster_n=2", "cluster_n=2+tile_fetch=dynamic"]
    assert vs[2]["gemm_options"] == {"cluster_n": 2, "tile_fetch": "dynamic"}
    assert B.variant_options(vs[2]).gemm_options["tile_fetch"] == "dynamic"
    with pytest.raises(ValueError, match="tile_fetch"):
        B.variant_options(B.parse_variants("tile_fetch=sometimes")[0])


def test_compile_key_separates_dynamic_and_keeps_static():
    """The cache key of the default is the one it had (no new element), dynamic's differs."""
    st, dy = GroupedGemm(), GroupedGemm(tile_fetch="dynamic")
    assert st._key(1024, 512) == GroupedGemm(tile_fetch="static")._key(1024, 512)
    assert "dynamic" not in st._key(1024, 512)
    assert dy._key(1024, 512) != st._key(1024, 512)


def test_fetch_counter_is_kept_per_device_and_capacity_and_zeroed_each_time():
    g = GroupedGemm(tile_fetch="dynamic")
    c = g.fetch_counter("cpu", 40)
    assert c.dtype == torch.int32 and c.numel() == 1 and int(c) == 0
    c.fill_(17)  # a previous launch's count
    assert g.fetch_counter("cpu", 40) is c and int(c) == 0
    assert g.fetch_counter("cpu", 41) is not c
    with pytest.raises(ValueError, match="tile_fetch"):
        GroupedGemm().fetch_counter("cpu", 40)


def test_trailing_arguments_keep_their_places():
    """The kernel's optional trailing arguments (tables, arrivals, counter): None before the
    last one given, nothing after; the static calls' argument lists are the ones they had."""
    T = GroupedGemm._trailing
    assert T(None, None, None) == ()
    assert T(("f", "s"), None, None) == ("f", "s")
    assert T(None, "a", None) == (None, None, "a")
    assert T(None, None, "c") == (None, None, None, "c")
    assert T(("f", "s"), "a", "c") == ("f", "s", "a", "c")


# ---------------------------------------------------------------- compile-only (CuTe DSL)
STATIC_PTX_CUTLASS = "4.8.1"
STATIC_PTX_SHA256 = {  # normalized PTX of cb699cc (before tile_fetch), N=1024, K=512
    "default": ({}, "4fbe916e2f1dd4e3fd89da224af862cda5a2e09ef609d5a78413a6b5e83f7865"),
    "c1": (dict(cluster_n=1), "38da83c67c2785dafedc0309f744f9826aededec9f1a003bb6852d07dd24c336"),
    "tm64_c1": (dict(tile_m=64, cluster_n=1),
                "fd7406fbe9f24dacd376e651ca4bc860e916809e5071a1405f697670f86dfd27"),
    "noflag": (dict(signal=False),
               "9ba6fc0d14a5d6a965a5c0cca3e21c5fc55d5798e9187f7fd13beb1b2be2893e"),
    "noflag_c1": (dict(signal=False, cluster_n=1),
                  "3af9881d8141746a9b2b84eb497fe7aaeaff3b651fea2074512f691f84acbe0c"),
    "knobs": (dict(flag_warp=False, signal_k_tile=-1, epi_n=64, epi_stages=2, band_group=1),
              "3ce018fc57da470f186c5aa270ea0b31b0119f32d3a4ac2e1c78dba742e87393"),
    "expert": (dict(group_by="expert"),
               "d5cdf0c71c3777564ac39d2c8dc4baae79a75c5ba38fdb1ba52099f963e94386"),
    "expert_c1": (dict(group_by="expert", cluster_n=1),
                  "0e2eaa4df04c88831313aa2ec3b6da038277847ec2c2db28c8536c15f087fae1"),
    "upproj": (dict(signal=False, wait_arrival=True, swiglu=True, cluster_n=1),
               "280ccca2f2d223de6775072d79ee1f60468afd56fc77a904cf2ea2efadb5b1fc"),
    "upproj_c2_expert": (dict(signal=False, wait_arrival=True, swiglu=True, cluster_n=2,
                              group_by="expert"),
                         "3dc6e1c879e57619a7e4cee0ade4baaa329595716c069fadf968f277c20e72b9"),
}


@pytest.fixture(scope="module")
def dsl():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import cutlass
    import cutlass.cute  # noqa: F401  (installed but broken: an error, not a skip)
    return cutlass


def _ptx(**kw):
    from moe_overlap.kernels.compile import kept_ptx
    return kept_ptx(GroupedGemm(**kw).compile(N=1024, K=512, keep_ptx=True))


def _normalized(ptx):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from ptx_fingerprint import normalize
    return normalize(ptx)


def _body(ptx):
    return ptx[ptx.index(".entry"):]


def _entry_params(ptx):
    return re.search(r"\.entry\s+\S+\((.*?)\)", ptx, re.S).group(1).count(".param")


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(STATIC_PTX_SHA256))
def test_static_ptx_is_the_kernel_before_the_option(dsl, name):
    kw, want = STATIC_PTX_SHA256[name]
    if dsl.__version__ != STATIC_PTX_CUTLASS:
        pytest.skip(f"hashes made with nvidia-cutlass-dsl {STATIC_PTX_CUTLASS}, this is "
                    f"{dsl.__version__}: compare with scripts/ptx_fingerprint.py instead")
    for fetch in ({}, dict(tile_fetch="static")):
        got = hashlib.sha256(_normalized(_ptx(**kw, **fetch)).encode()).hexdigest()
        assert got == want, (name, fetch)


FETCH = "atom.relaxed.gpu.global.add.s32"  # the work counter's atomic
MAPA = "mapa.shared::cluster.u32"
ST_PEER = "st.shared::cluster.s32"  # the unit into the peer's ring slot
ARRIVE_CLUSTER = "mbarrier.arrive.release.cluster.shared::cluster.b64"
WAIT_CLUSTER = "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64"


@pytest.mark.compile
@pytest.mark.parametrize("extra", [
    dict(cluster_n=1), dict(cluster_n=2), dict(cluster_n=1, signal=False),
    dict(cluster_n=2, signal=False), dict(cluster_n=2, flag_warp=False),
    dict(cluster_n=2, group_by="expert"), dict(cluster_n=1, group_by="expert", tile_m=64),
    dict(cluster_n=1, signal=False, wait_arrival=True, swiglu=True),
    dict(cluster_n=2, signal=False, wait_arrival=True, swiglu=True, group_by="expert")])
def test_dynamic_kernel_fetches_and_hands_units_through_the_ring(dsl, extra):
    """Dynamic = static + one kernel parameter (the counter) + the fetch: the atomic on the
    counter at the producer warp's three tile picks (next tile, and the skip loop of its two
    band_tile calls), ring traffic in shared memory; with clusters of 2 the unit goes to the
    peer CTA through distributed shared memory (st.shared::cluster at the three posts, a
    release.cluster arrive on the peer's full barrier there) and every reader hands the slot
    back with a release.cluster arrive on the leader's empty barrier; with clusters of 1 none
    of that cluster traffic. The static kernel has neither the atomic nor any of it."""
    static = _ptx(**extra)
    dyn = _ptx(tile_fetch="dynamic", **extra)
    sb, db = _body(static), _body(dyn)
    assert "wgmma.mma_async" in db
    assert _entry_params(dyn) == _entry_params(static) + 1
    assert FETCH not in sb and db.count(FETCH) == 3
    if extra["cluster_n"] == 2:
        assert db.count(ST_PEER) == 3 and ST_PEER not in sb
        # posts: 3 sites x 1 arrive on the peer's full; takes: 3 sites in the consumer
        # warps + 3 in the peer's producer warp, each arriving on the leader's empty
        assert db.count(ARRIVE_CLUSTER) - sb.count(ARRIVE_CLUSTER) == 3 + 6
        assert db.count(MAPA) > sb.count(MAPA)
        assert db.count(WAIT_CLUSTER) > sb.count(WAIT_CLUSTER)
    else:
        for op in (ST_PEER, ARRIVE_CLUSTER, MAPA, WAIT_CLUSTER):
            assert db.count(op) == sb.count(op), op
        assert "mbarrier.arrive.shared::cta.b64" in db  # the ring's local full / empty arrives
    # the ring's barriers: 2 full (count 1) + 2 empty (count = reader warps) more inits
    readers = 4 * (2 if extra.get("tile_m", 128) > 64 else 1) * extra["cluster_n"] + \
        extra["cluster_n"] - 1
    inits = lambda b: re.findall(r"mbarrier\.init\.shared::cta\.b64 \[[^\]]+\], (\d+);", b)  # noqa: E731
    extra_inits = sorted(inits(db))
    for v in inits(sb):
        extra_inits.remove(v)
    assert sorted(extra_inits) == sorted(["1", "1", str(readers), str(readers)])


@pytest.mark.compile
def test_sm_hold_helper_compiles(dsl):
    """The GPU test's stand-in consumer (tests/sm_hold.py): the hold CTAs' shared memory, their
    count, the timed spin and the waiter's acquire loads."""
    sys.path.insert(0, os.path.dirname(__file__))
    from sm_hold import build_sm_hold, sm_hold_example_args
    from moe_overlap.kernels.compile import compile_keep, kept_ptx
    ptx = kept_ptx(compile_keep(build_sm_hold(), *sm_hold_example_args()))
    assert ptx.count(".entry") == 2
    assert "red.release.gpu.global.add.s32" in ptx and "ld.acquire.gpu.global.s32" in ptx
    assert "globaltimer" in ptx
