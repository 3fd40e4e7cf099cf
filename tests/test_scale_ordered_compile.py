"""Compile-only (sm_90a, no GPU) checks of the ordered scale (moe_overlap/combine/scale_ordered.py):
the PTX carries the ordering the design relies on (bench/NOTES.md, "Session 11")."""
import os
import re

import pytest

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx as _ptx  # noqa: E402


def _entries(ptx):
    parts = re.split(r"\.entry\s+", ptx)[1:]
    return {p.split("(", 1)[0].strip(): p for p in parts}


@pytest.fixture(scope="module", params=[4, 8])
def ordered(request):
    from moe_overlap.combine.scale_ordered import build_ordered_scale, ordered_scale_example_args
    ents = _entries(_ptx(build_ordered_scale(request.param), *ordered_scale_example_args()))
    assert len(ents) == 1  # one persistent kernel: markers, claims, waits and the scale
    return request.param, next(iter(ents.values()))


def _spins(body, load):
    """Every loop whose body holds ``load``: (label, loop text)."""
    out = []
    for m in re.finditer(r"^\$(\w+):\n", body, re.M):
        lab = m.group(1)
        j = body.find(f"bra.uni \t${lab};", m.end())
        if j < 0:
            j = body.find(f"${lab};", m.end())
        if j > 0 and load in body[m.end():j]:
            out.append((lab, body[m.end():j]))
    return out


def test_every_wait_is_bounded_and_scoped(ordered):
    _, body = ordered
    # segments and markers: sys-scope acquire (peers' consumers); local bands: gpu scope (this
    # GPU's producer); nothing else spins
    assert "ld.acquire.sys.global.s64" in body and "ld.acquire.gpu.global.s32" in body
    assert "ld.acquire.gpu.global.s64" not in body and "ld.acquire.sys.global.s32" not in body
    for load in ("ld.acquire.sys.global.s64", "ld.acquire.gpu.global.s32"):
        # the innermost loops around the load (the spins; outer loops hold them trivially)
        loops = [t for _, t in _spins(body, load) if t.count("bra") <= 4]
        assert loops, load
        assert all("%globaltimer" in t for t in loops), load  # every spin reads the clock
    # the sys-scope waits (markers, segments: a peer's consumer) also poll that peer's error
    # word, a relaxed sys-scope load (another GPU writes it)
    sys_loops = [t for _, t in _spins(body, "ld.acquire.sys.global.s64") if t.count("bra") <= 4]
    assert all("ld.relaxed.sys.global.s64" in t for t in sys_loops)
    # each timeout is recorded (first writer wins): band 7, segment 8, marker 2; a peer's
    # error word seen while waiting for its marker or segments: 10
    for code in (2, 7, 8, 10):
        assert re.search(rf"atom\.relaxed\.gpu\.global\.cas\.b64 %rd\d+, \[%rd\d+\], 0, {code};",
                         body), code


def test_claim_then_barrier_then_waits_then_join_then_rows(ordered):
    _, body = ordered
    i_err = body.index("ld.relaxed.gpu.global.s64")  # the error word, before anything else
    i_claim = body.index("atom.relaxed.gpu.global.add.u32")
    i_sync = body.index("bar.sync", i_claim)
    i_band = body.index("ld.acquire.gpu.global.s32")
    joins = [m.start() for m in re.finditer(r"bar\.red\.or\.pred", body)]
    i_row = body.index("ld.global.cg.v4.u32")
    assert i_err < i_claim < i_sync < i_band
    # the tile's join (bar.red.or after the claim) precedes every row load of the slot / y
    assert any(i_sync < j < i_row for j in joins)
    assert not re.search(r"ld\.global\.nc", body)  # rows written by running kernels: never .nc
    assert "multimem" not in body  # never NVLink multicast


def test_arithmetic_matches_the_default_scale(ordered):
    """Same fma chain as scale.py (bitwise-equal outputs): 8 accumulators x TOPK fma.rn.f32, the
    first of each chain on 0, then cvt.rn.bf16x2; NaN fill present."""
    topk, body = ordered
    from moe_overlap.combine.scale import BF16X2_NAN, build_scale, scale_example_args
    ref = next(b for n, b in _entries(_ptx(build_scale(topk, y_src=True),
                                           *scale_example_args())).items()
               if "scale_kernel" in n)
    for b in (body, ref):
        assert b.count("fma.rn.f32") == 8 * topk
        assert len(re.findall(r"fma\.rn\.f32\s+%r\d+, %r\d+, %r\d+, 0f00000000;", b)) == 8
        assert b.count("cvt.rn.bf16x2.f32") == 4
    assert str(BF16X2_NAN) in body
    assert ".local" not in body


def test_ordered_scale_checks_its_arguments():
    from moe_overlap.combine.scale_ordered import OrderedScale, build_ordered_scale
    with pytest.raises(ValueError, match="topk"):
        build_ordered_scale(0)
    with pytest.raises(ValueError, match="threads"):
        OrderedScale(4, threads=48)


def test_worker_build_fits_one_cta_per_sm():
    """The consumer workers' CTAs (bench/bench_ordered_scale.py WORKER_THREADS) must fit one per
    SM next to nothing else: registers x threads within the register file."""
    from conftest import compile_ptx_cubin
    from moe_overlap.combine.scale_ordered import build_ordered_scale, ordered_scale_example_args
    from moe_overlap.runtime.device import cubin_resources
    threads = 512
    _, cubin = compile_ptx_cubin(build_ordered_scale(8, threads), *ordered_scale_example_args())
    (regs, _), = cubin_resources(cubin).values()
    assert 0 < regs * threads <= 65536, regs


def test_launch_refuses_bad_inputs_before_compiling():
    import torch
    from moe_overlap.combine import ordered_scale as osc
    from moe_overlap.combine.scale_ordered import OrderedScale
    from moe_overlap.routing import route
    ids = [route(64, 8, 2, "balanced", seed=0, rank=r)[0] for r in range(2)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=8) for i in ids])
    plans = osc.sender_plans(counts, 64, 1, "packed")
    deps = osc.row_dependencies(ids[0], counts, 0, plans)
    tiles = osc.token_tiles(deps, torch.zeros(deps.kind.shape, dtype=torch.float64), 16)
    tables = osc.tile_tables(tiles)
    assert all(t.dtype == torch.int32 for t in tables.values())
    sc = OrderedScale(2)
    seg = osc.seg_expected_inc(plans, 0)
    good = dict(rows=torch.zeros(64, 2, dtype=torch.int32), weights=torch.zeros(64, 2),
                out=torch.zeros(64, 16, dtype=torch.bfloat16), tables=tables,
                band_ready=torch.zeros(4, dtype=torch.int32), seg_arrivals=seg.clone(),
                seg_expected=seg, queue=torch.zeros(1, dtype=torch.int32),
                err=torch.zeros(8, dtype=torch.int64), epoch=torch.zeros(1, dtype=torch.int32))
    sc.check(**good)
    with pytest.raises(TypeError, match="weights"):
        sc.check(**dict(good, weights=torch.zeros(64, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="seg_expected"):
        sc.check(**dict(good, seg_expected=seg[:, :1].contiguous()))
    with pytest.raises(ValueError, match="tokens"):
        sc.check(**dict(good, tables=dict(tables, order=tables["order"][:10])))
    assert sc._fn is None  # nothing compiled


@pytest.mark.parametrize("copy", ["ldst", "tma"])
def test_consumer_segment_arrivals(copy):
    """arrival="segment": the same fence + release per piece, to another word (seg_arrivals after
    the communication block: the offset uses the world size and the segment capacity)."""
    from moe_overlap.combine.consumer import build_consumer, consumer_example_args
    bodies = {a: _ptx(build_consumer("nvlink", copy=copy, local_copy=False, arrival=a),
                      *consumer_example_args()).split(".entry", 1)[1]
              for a in ("counter", "segment")}
    assert bodies["counter"] != bodies["segment"]
    for body in bodies.values():
        reds = [m.start() for m in re.finditer(r"red\.release\.sys\.global\.add\.u64", body)]
        assert len(reds) == len(re.findall(r"red\.release\.sys\.global\.add\.u64",
                                           bodies["counter"]))
        # every arrival release (not the call marker, the first one) follows a sys fence
        for r in reds[1:]:
            assert body.rfind("fence.acq_rel.sys", 0, r) > body.rfind("red.release", 0, r - 1)


def test_consumer_segment_arrivals_refuse_the_local_copy():
    from moe_overlap.combine.consumer import Consumer, build_consumer
    with pytest.raises(ValueError, match="local_copy=False"):
        build_consumer("nvlink", local_copy=True, arrival="segment")
    with pytest.raises(ValueError, match="arrival"):
        Consumer("nvlink", local_copy=False, arrival="pigeon")
