"""GPU correctness of the producer grouped GEMM (skipped without CUDA / CuTe DSL).

Bands come from moe_overlap.combine.plan.plan_combine (falls back to a local band builder if the
planner is absent).  Each case: fresh random inputs, y poisoned with NaN, every row of every valid
band checked against an fp32 reference per expert, rows of no band untouched, every valid band's
flag == epoch after the call; two consecutive calls (epoch 1 then 2, no reset in between).
"""
import zlib

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap.combine.grouped_gemm import GroupedGemm  # noqa: E402

try:
    from moe_overlap.combine.plan import plan_combine
except ImportError:  # pragma: no cover
    plan_combine = None

DEV = "cuda"
N, K = 512, 256
_GEMMS = {}


def _gemm(tile_m, tile_n, **kw):
    key = (tile_m, tile_n, tuple(sorted(kw.items())))
    if key not in _GEMMS:
        _GEMMS[key] = GroupedGemm(tile_m=tile_m, tile_n=tile_n, **kw)
    return _GEMMS[key]


def _local_plan(local_counts, tile_m):
    """Fallback band builder: per local expert, ceil(c / tile_m) bands, stacked expert-major."""
    be, bs, start = [], [], 0
    for e, c in enumerate(local_counts):
        nb = (c + tile_m - 1) // tile_m
        for k in range(nb):
            be.append(e)
            bs.append(start + k * tile_m)
        start += nb * tile_m
    cap = len(be) + 3
    pad = lambda v: torch.tensor(v + [-1] * (cap - len(v)), dtype=torch.int32, device=DEV)
    sched = list(range(len(be)))[::-1]  # a non-trivial order
    return dict(band_expert=pad(be), band_src_row=pad(bs), schedule=pad(sched),
                num_bands=torch.tensor([len(be)], dtype=torch.int32, device=DEV),
                total_rows=start, cap=cap)


def _make_plan(counts, rank, tile_m, layout="aligned"):
    """counts: [W, E] int (host). Returns band tensors + host facts for rank's local experts."""
    W, E = counts.shape
    El = E // W
    if plan_combine is not None:
        p = plan_combine(counts.to(DEV), rank, tile_m=tile_m, layout=layout)
        return dict(band_expert=p.band_expert, band_src_row=p.band_src_row, schedule=p.schedule,
                    num_bands=p.num_bands, total_rows=int(p.total_rows.item()),
                    cap=p.band_capacity, El=El)
    local = counts[:, rank * El:(rank + 1) * El].sum(0).tolist()
    d = _local_plan(local, tile_m)
    d["El"] = El
    return d


def _counts(kind, W, El, gen):
    E = W * El
    if kind == "balanced":
        return torch.full((W, E), 96, dtype=torch.int64)
    if kind == "skew":  # stress skew: heavy-tailed, a few experts get most rows
        c = (torch.rand(W, E, generator=gen) ** 4 * 600).long()
        c[:, 0] += 700
        return c
    if kind == "zero_expert":
        c = torch.randint(1, 300, (W, E), generator=gen)
        c[:, 1] = 0
        return c
    if kind == "one_expert":
        c = torch.zeros(W, E, dtype=torch.int64)
        c[:, El - 1] = 333
        return c
    raise ValueError(kind)


CASES = [
    # (kind, W, El, tile_m, tile_n, ccta)
    ("balanced", 1, 4, 128, 256, 0),
    ("skew", 2, 4, 128, 256, 8),
    ("zero_expert", 8, 2, 64, 256, 24),
    ("one_expert", 2, 4, 64, 128, 0),
    ("skew", 8, 2, 128, 128, 24),
    ("balanced", 2, 3, 64, 256, 8),
    ("zero_expert", 1, 4, 128, 256, 24),
    ("one_expert", 8, 2, 128, 256, 8),
]


@pytest.mark.parametrize("kind,W,El,tile_m,tile_n,ccta", CASES)
def test_grouped_gemm_matches_reference(kind, W, El, tile_m, tile_n, ccta):
    _check_case(kind, W, El, tile_m, tile_n, ccta)


@pytest.mark.parametrize("kind,W,El,tile_m,tile_n,ccta", [c for c in CASES if c[1] > 1])
def test_grouped_gemm_on_packed_layout(kind, W, El, tile_m, tile_n, ccta):
    """The producer on packed plans (bands holding rows of several sources): same checks."""
    _check_case(kind, W, El, tile_m, tile_n, ccta, layout="packed")


@pytest.mark.parametrize("kind,W,El,tile_m,tile_n,ccta,extra", [
    ("skew", 2, 4, 128, 256, 0, dict(cluster_n=1, signal_k_tile=3)),
    ("zero_expert", 8, 2, 64, 256, 7, dict(cluster_n=2)),
    ("one_expert", 1, 4, 128, 128, 24, dict(cluster_n=2, epi_n=64, epi_stages=2)),
    ("balanced", 2, 4, 64, 128, 8, dict(cluster_n=1, signal_k_tile=-1)),
    ("skew", 1, 4, 128, 256, 8, dict(cluster_n=2, signal_k_tile=1)),
    ("skew", 2, 4, 128, 256, 0, dict(flag_warp=False)),
    ("zero_expert", 8, 2, 64, 128, 24, dict(flag_warp=False, cluster_n=1)),
    ("one_expert", 2, 4, 64, 256, 7, dict(flag_warp=False, epi_n=64, epi_stages=2)),
    ("skew", 2, 4, 128, 256, 0, dict(flag_warp=True)),
    ("zero_expert", 8, 2, 64, 128, 24, dict(flag_warp=True, cluster_n=1)),
    ("one_expert", 1, 4, 128, 256, 8, dict(flag_warp=True, signal_k_tile=-1)),
    ("skew", 2, 4, 128, 256, 0, dict(band_group=2)),
    ("balanced", 2, 3, 64, 128, 8, dict(band_group=2, cluster_n=1)),
    ("zero_expert", 8, 2, 128, 256, 24, dict(band_group=2, flag_warp=True)),
    ("skew", 2, 4, 128, 256, 8, dict(band_group=1, flag_warp=False)),
    ("skew", 2, 4, 128, 256, 0, dict(band_group=1)),
    ("balanced", 8, 2, 64, 128, 24, dict(band_group=3, cluster_n=1)),
])
def test_grouped_gemm_cluster_and_options(kind, W, El, tile_m, tile_n, ccta, extra):
    _check_case(kind, W, El, tile_m, tile_n, ccta, **extra)


def _check_case(kind, W, El, tile_m, tile_n, ccta, layout="aligned", **extra):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, W, El, tile_m, tile_n, ccta)).encode()))
    counts = _counts(kind, W, El, gen)
    rank = W - 1
    plan = _make_plan(counts, rank, tile_m, layout)
    nb = int(plan["num_bands"].item())
    total = plan["total_rows"]
    rows = total + 2 * tile_m  # rows past the last band must stay untouched
    g = _gemm(tile_m, tile_n, **extra)
    band_ready = torch.zeros(plan["cap"], dtype=torch.int32, device=DEV)
    epoch = torch.zeros(1, dtype=torch.int32, device=DEV)
    sched = plan["schedule"][:nb].tolist()
    be = plan["band_expert"].tolist()
    bs = plan["band_src_row"].tolist()
    for call in (1, 2):
        x = torch.randn(rows, K, device=DEV).to(torch.bfloat16)
        w = (torch.randn(El, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
        y = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        epoch.fill_(call)
        g(x, w, y, plan["band_expert"], plan["band_src_row"], plan["schedule"], plan["num_bands"],
          band_ready, epoch, ccta=ccta)
        torch.cuda.synchronize()
        covered = torch.zeros(rows, dtype=torch.bool, device=DEV)
        for e in range(El):
            rs = [bs[b] for b in sched if be[b] == e]
            if not rs:
                continue
            idx = torch.cat([torch.arange(r, r + tile_m, device=DEV) for r in rs])
            covered[idx] = True
            ref = x[idx].float() @ w[e].float()
            out = y[idx].float()
            assert not torch.isnan(out).any(), f"expert {e}: unwritten rows (call {call})"
            rel = ((out - ref).norm() / ref.norm().clamp_min(1e-6)).item()
            assert rel < 1e-2, f"expert {e}: rel err {rel:.3e} (call {call})"
        assert torch.isnan(y[~covered].float()).all(), "rows of no band were written"
        ready = band_ready.tolist()
        for b in sched:
            assert ready[b] == call, f"band {b}: flag {ready[b]} != epoch {call}"
        valid = set(sched)
        assert all(ready[b] == 0 for b in range(plan["cap"]) if b not in valid)
        cnt = g._counters[(x.device, band_ready.numel())]
        assert int(cnt.abs().sum()) == 0, "band tile counters must return to 0"


def test_no_flags_variant_and_empty_plan():
    tile_m = 128
    g = GroupedGemm(tile_m=tile_m, tile_n=256, signal=False)
    counts = torch.full((1, 4), 200, dtype=torch.int64)
    plan = _make_plan(counts, 0, tile_m)
    rows = plan["total_rows"]
    x = torch.randn(rows, K, device=DEV).to(torch.bfloat16)
    w = (torch.randn(4, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
    y = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    ready = torch.zeros(plan["cap"], dtype=torch.int32, device=DEV)
    epoch = torch.ones(1, dtype=torch.int32, device=DEV)
    g(x, w, y, plan["band_expert"], plan["band_src_row"], plan["schedule"], plan["num_bands"],
      ready, epoch)
    torch.cuda.synchronize()
    assert not torch.isnan(y.float()).any()
    assert int(ready.abs().sum()) == 0  # flags disabled at compile time
    # zero bands: nothing written, nothing hangs
    y.fill_(float("nan"))
    nb0 = torch.zeros(1, dtype=torch.int32, device=DEV)
    _gemm(tile_m, 256)(x, w, y, plan["band_expert"], plan["band_src_row"], plan["schedule"], nb0,
                       ready, epoch)
    torch.cuda.synchronize()
    assert torch.isnan(y.float()).all() and int(ready.abs().sum()) == 0
