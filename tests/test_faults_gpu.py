"""GPU checks of the combine's fault handling (issue 21) on ONE GPU: OverlapCombine with a world of
one rank (local rows only: producer, consumer local copy, scale), so they run wherever one H200 is.
One spawned process (NCCL group of 1, NVSHMEM with 1 PE) runs every check in sequence and writes
JSON that the tests read. Per config (v1: local copy + thread copies; v2: local_copy=False + TMA):

- ``good``: forward vs the fp32 reference, error word clear, this call's epoch tag written (the
  plan's counts fingerprint << 32 | the epoch);
- ``mismatch``: consumer of epoch e, then the epoch moved by 2 (a source two calls behind: the same
  slot parity, so the counters alone pass), then the scale: ERR_EPOCH_MISMATCH naming both epochs,
  ``out`` all NaN, the slot not read;
- ``sticky``: the next full forward after that error: NaN out, the error word kept (first error),
  no call marker posted, no receive-buffer row written;
- ``reset``: ``OverlapCombine.reset()`` (error word, communication block, expected counts,
  epoch and band flags zeroed between two barriers), then 100 correct calls;
- ``bad_row``: the scale with one slot row (and, v2, one y row) out of range: ERR_SCALE_BAD_ROW,
  those tokens' rows NaN, every other row equal to ``scale_torch`` (to bf16 rounding);
- ``bad_plan`` (v1): a local cell whose destination rows lie past the slot, and a cell count past
  the capacity: ERR_PLAN_BOUNDS, nothing written outside the slot;
- ``scale_timeout``: the scale waits for a row that never comes: ERR_SCALE_TIMEOUT naming the
  source and the epoch.

Run: ``CUDA_MODULE_LOADING=EAGER python -m pytest -q tests/test_faults_gpu.py``.
"""

import pytest
import torch

from conftest import record_single_rank, require_module, single_rank_json, worker_error

pytestmark = pytest.mark.gpu

require_module(gpus=1)

E, TOPK, K, N, TILE_M, T_MAX = 4, 2, 256, 512, 128, 256
CONFIGS = {"v1": dict(local_copy=True, copy="ldst"), "v2": dict(local_copy=False, copy="tma")}


def _case(ov, T, seed):
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.routing import route
    dev = ov.device
    ids, w = route(T, E, TOPK, mode="moderate_skew", seed=seed, rank=ov.rank, device=dev)
    plan = plan_combine(exchange_counts(ids, E), ov.rank, tile_m=TILE_M, mgb=2,
                        max_rows=ov.world_size * T_MAX * TOPK)
    g = torch.Generator(device=dev).manual_seed(seed)
    h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(ov.experts_per_rank, K, N, device=dev, generator=g) / K ** 0.5).to(
        torch.bfloat16)
    return ids, w, plan, h, wd


def _rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _err(ov):
    torch.cuda.synchronize(ov.device)
    return [int(v) for v in ov.err.tolist()]


def _reset(ov):
    """The collective reset (W=1 here): error word, counters, tags, expected counts, epoch and
    band flags zeroed, the host read-back forgotten (else the next forward raises the error
    read back after the sticky call)."""
    ov.reset()
    assert _err(ov)[0] == 0 and not ov.buffers.block.any() and int(ov.epoch.item()) == 0


def _ship_ready(ov, ids, w, plan, y):
    """begin_call + consumer with every band flag already set (y: [rows + 1, N]); returns the
    scale's (rows, weights)."""
    rows, weights = ov.begin_call(ids, w, plan)
    cap = plan.band_capacity
    flags = torch.where(torch.arange(cap, device=ov.device) < plan.num_bands,
                        ov.epoch.expand(cap), torch.zeros_like(ov.epoch).expand(cap)).contiguous()
    ov.warmup()
    ov.ship(y, plan, flags)
    return rows, weights


def _checks(ov, res, tag):
    from moe_overlap.combine.reference import reference_combine
    from moe_overlap.combine.scale import scale_torch
    from moe_overlap.kernels import errors as Er
    dev, W = ov.device, ov.world_size

    # ---- good call ----
    ids, w, plan, h, wd = _case(ov, 200, 1)
    out = ov.forward(h, wd, plan, ids, w)
    res[f"{tag}_good_rel"] = _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w))
    res[f"{tag}_good_err"] = _err(ov)
    e = int(ov.epoch.item())
    res[f"{tag}_good_tag"] = [int(ov.buffers.block[Er.epoch_tag_word(W, e & 1, 0)]), e,
                              int(plan.counts_fingerprint)]

    # ---- epoch mismatch: consumer at e, scale at e + 2 (same parity) ----
    ids, w, plan, h, wd = _case(ov, 180, 2)
    y = torch.randn(plan.row_capacity + 1, N, device=dev).to(torch.bfloat16)
    rows, weights = _ship_ready(ov, ids, w, plan, y)
    e = int(ov.epoch.item())
    ov.epoch.add_(2)
    out = torch.zeros(ids.shape[0], N, dtype=torch.bfloat16, device=dev)
    ov.scale.launch(recv=ov.recv, rows=rows, weights=weights, out=out, counters=ov.counters,
                    expected=ov.expected, rank=ov.rank, err=ov.err, epoch=ov.epoch,
                    slot_bytes=ov.slot_bytes, num_sms=ov.num_sms, y=y, epoch_tags=True,
                    fingerprint=plan.counts_fingerprint)
    err = _err(ov)
    res[f"{tag}_mismatch_err"] = err
    res[f"{tag}_mismatch_epochs"] = [e, e + 2]
    res[f"{tag}_mismatch_fingerprint"] = int(plan.counts_fingerprint)
    res[f"{tag}_mismatch_msg"] = Er.describe_error(err) or ""
    res[f"{tag}_mismatch_out_nan"] = bool(torch.isnan(out.float()).all())

    # ---- sticky: a full call after the error ----
    ids, w, plan, h, wd = _case(ov, 150, 3)
    ov.recv.fill_(1.5)
    ctr0 = ov.counters.clone()
    out = ov.forward(h, wd, plan, ids, w)
    res[f"{tag}_sticky_err_kept"] = _err(ov) == err
    res[f"{tag}_sticky_out_nan"] = bool(torch.isnan(out.float()).all())
    res[f"{tag}_sticky_no_marker"] = bool(torch.equal(ov.counters, ctr0))
    res[f"{tag}_sticky_recv_untouched"] = bool((ov.recv.float() == 1.5).all())

    # ---- reset, then 100 correct calls ----
    _reset(ov)
    worst, bad_err = 0.0, None
    for i in range(100):
        ids, w, plan, h, wd = _case(ov, 64 + (i * 37) % 190, 100 + i)
        out = ov.forward(h, wd, plan, ids, w)
        if i % 10 == 0 or i == 99:
            worst = max(worst, _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w)))
            if _err(ov)[0]:
                bad_err = _err(ov)
    res[f"{tag}_reset_worst_rel"] = worst
    res[f"{tag}_reset_err"] = bad_err or _err(ov)

    # ---- bad rows in the scale ----
    ids, w, plan, h, wd = _case(ov, 160, 4)
    y = torch.randn(plan.row_capacity + 1, N, device=dev).to(torch.bfloat16)
    rows, weights = _ship_ready(ov, ids, w, plan, y)
    torch.cuda.synchronize(dev)
    bad = rows.clone()
    bad[3, 1] = ov.max_recv_rows + 5  # past the slot
    bad_tokens = [3]
    if not ov.local_copy:
        bad[7, 0] = -(y.shape[0] + 3) - 1  # y row past y
        bad_tokens.append(7)
    out = torch.zeros(ids.shape[0], N, dtype=torch.bfloat16, device=dev)
    ov.scale.launch(recv=ov.recv, rows=bad, weights=weights, out=out, counters=ov.counters,
                    expected=ov.expected, rank=ov.rank, err=ov.err, epoch=ov.epoch,
                    slot_bytes=ov.slot_bytes, num_sms=ov.num_sms, y=y, epoch_tags=True,
                    fingerprint=plan.counts_fingerprint)
    err = _err(ov)
    res[f"{tag}_bad_row_err"] = err
    good = torch.ones(ids.shape[0], dtype=torch.bool)
    good[bad_tokens] = False
    ref = scale_torch(ov.recv_slot(), rows, weights, y=None if ov.local_copy else y[:-1])
    res[f"{tag}_bad_row_nan_rows"] = bool(torch.isnan(out[~good.to(dev)].float()).all())
    # the same arithmetic as the reference up to fma contraction: a bf16 rounding at most
    res[f"{tag}_bad_row_others_rel"] = _rel(out[good.to(dev)], ref[good.to(dev)].float())
    _reset(ov)

    # ---- consumer: a plan entry outside its buffers (v1: the local cells) ----
    if ov.local_copy:
        for what in ("dest", "count"):
            ids, w, plan, h, wd = _case(ov, 120, 5)
            y = torch.randn(plan.row_capacity + 1, N, device=dev).to(torch.bfloat16)
            if what == "dest":
                plan.local_cell_dest_row[0] = ov.max_recv_rows  # its rows lie past the slot
            else:
                plan.num_local_cells.fill_(plan.local_cell_rows.numel() + 1)
            ov.recv.fill_(2.5)
            _ship_ready(ov, ids, w, plan, y)
            err = _err(ov)
            parity = int(ov.epoch.item()) & 1
            other = ov.recv.view(2, ov.max_recv_rows, N)[parity ^ 1]
            res[f"{tag}_bad_plan_{what}_err"] = err
            res[f"{tag}_bad_plan_{what}_other_slot_untouched"] = bool((other.float() == 2.5).all())
            _reset(ov)

    # ---- scale timeout names source and epoch ----
    ids, w, plan, h, wd = _case(ov, 100, 6)
    ov.scale.timeout_ns = 200_000_000
    rows, weights = ov.begin_call(ids, w, plan)
    out = torch.zeros(ids.shape[0], N, dtype=torch.bfloat16, device=dev)
    ov.scale.launch(recv=ov.recv, rows=rows, weights=weights, out=out, counters=ov.counters,
                    expected=ov.expected, rank=ov.rank, err=ov.err, epoch=ov.epoch,
                    slot_bytes=ov.slot_bytes, num_sms=ov.num_sms, y=y, epoch_tags=True,
                    fingerprint=plan.counts_fingerprint)
    err = _err(ov)
    res[f"{tag}_timeout_err"] = err
    res[f"{tag}_timeout_epoch"] = int(ov.epoch.item())
    res[f"{tag}_timeout_msg"] = Er.describe_error(err) or ""
    res[f"{tag}_timeout_out_nan"] = bool(torch.isnan(out.float()).all())


def _worker(rank, world, port, outdir):
    def body(res):
        from moe_overlap.combine.overlap import OverlapCombine
        for tag, opts in CONFIGS.items():
            try:
                ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N,
                                    topk=TOPK, max_tokens_per_rank=T_MAX, tile_m=TILE_M, ccta=8,
                                    transport="nvlink", timeout_s=10.0, **opts)
                _checks(ov, res, tag)
            except Exception as e:
                res[f"{tag}_error"] = worker_error(e)
    record_single_rank(rank, world, port, outdir, body)


@pytest.fixture(scope="module")
def results():
    r = single_rank_json(_worker)
    assert "error" not in r, r["error"]
    return r


@pytest.fixture(params=list(CONFIGS))
def tag(request, results):
    assert f"{request.param}_error" not in results, results[f"{request.param}_error"]
    return request.param


def test_good_call_and_epoch_tag(results, tag):
    r = results
    assert r[f"{tag}_good_rel"] < 1e-2 and r[f"{tag}_good_err"][0] == 0, r
    tag_v, epoch, fp = r[f"{tag}_good_tag"]
    from moe_overlap.kernels.errors import call_tag
    assert tag_v == call_tag(epoch, fp), r  # the plan's counts fingerprint << 32 | the epoch


def test_epoch_mismatch_recorded_and_slot_not_read(results, tag):
    from moe_overlap.kernels.errors import ERR_EPOCH_MISMATCH
    r = results
    from moe_overlap.kernels.errors import call_tag
    err, (e_src, e_mine) = r[f"{tag}_mismatch_err"], r[f"{tag}_mismatch_epochs"]
    fp = r[f"{tag}_mismatch_fingerprint"]
    assert err[0] == ERR_EPOCH_MISMATCH, r
    # source 0, both tags (one plan: the same fingerprint, the epochs two apart)
    assert err[2] == 0 and err[4] == call_tag(e_src, fp) and err[5] == call_tag(e_mine, fp), r
    assert "out of step" in r[f"{tag}_mismatch_msg"], r
    assert r[f"{tag}_mismatch_out_nan"], r


def test_errors_are_sticky(results, tag):
    r = results
    assert r[f"{tag}_sticky_err_kept"] and r[f"{tag}_sticky_out_nan"], r
    assert r[f"{tag}_sticky_no_marker"] and r[f"{tag}_sticky_recv_untouched"], r


def test_reset_then_100_correct_calls(results, tag):
    r = results
    assert r[f"{tag}_reset_err"][0] == 0, r
    assert r[f"{tag}_reset_worst_rel"] < 1e-2, r


def test_scale_bad_rows(results, tag):
    from moe_overlap.kernels.errors import ERR_SCALE_BAD_ROW
    r = results
    assert r[f"{tag}_bad_row_err"][0] == ERR_SCALE_BAD_ROW, r
    assert r[f"{tag}_bad_row_nan_rows"], r
    assert r[f"{tag}_bad_row_others_rel"] < 1e-2, r


def test_consumer_plan_bounds(results):
    from moe_overlap.kernels.errors import ERR_PLAN_BOUNDS
    r = results
    assert "v1_error" not in r, r
    for what, field in (("dest", 7), ("count", 1)):
        err = r[f"v1_bad_plan_{what}_err"]
        assert err[0] == ERR_PLAN_BOUNDS and err[3] == field, (what, r)
        assert r[f"v1_bad_plan_{what}_other_slot_untouched"], (what, r)


def test_scale_timeout_names_source_and_epoch(results, tag):
    from moe_overlap.kernels.errors import ERR_SCALE_TIMEOUT
    r = results
    err = r[f"{tag}_timeout_err"]
    assert err[0] == ERR_SCALE_TIMEOUT and err[2] == 0 and err[3] == r[f"{tag}_timeout_epoch"], r
    assert "source rank 0" in r[f"{tag}_timeout_msg"], r
    assert r[f"{tag}_timeout_out_nan"], r
