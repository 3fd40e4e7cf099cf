"""Where ours' combine spends its time inside one MoE layer on one GPU: the layer of
bench_moe_layer.py for one shape (its routing, plan and up-projection output h), then, each
timed alone with CUDA events (median of --rounds after a warm-up):

- produce: the producer grouped GEMM alone at ccta = 0 and at the layer's ccta;
- forward(overlap=False) (the producer on every SM, then the consumer, then the scale) and
  forward(overlap=True) (the call the layer makes);
- the same GEMM (the layer's kernel for each ccta) on balanced bands (every expert the same
  whole bands, identity schedule: the layout of bench_grouped_gemm.py) of the same E, K, N, at
  the plan's bands per expert rounded down and up (groups of band_group bands then span two
  experts, or up to three as on the plan), to tell the plan from the kernel;
- --sweep: the producer on the layer's plan at band_group 2 / 4 / 8 / 16 x cluster 1 / 2, fixed
  groups (group_by="position") and groups cut at expert boundaries (group_by="expert", 4 / 8 /
  16; its output checked bitwise against band_group 8's on the plan's rows), and the
  expert-cut tables' own launch (combine/band_groups.py) alone;
- --group-by expert: the layer's producer (produce / forward rows) with
  gemm_options={"group_by": "expert"}, as MoECombine would launch it with that switch.

    PYTHONPATH=$PWD python bench/profile_combine_layer.py --shape deepseek-v3@16384
    PYTHONPATH=$PWD python bench/profile_combine_layer.py --shape deepseek-v3@16384 --sweep \
        --group-by expert

Printed only: a diagnosis for bench/NOTES.md, not a headline.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe_layer as L  # noqa: E402  (sets the NVSHMEM / NCCL environment first)
from moe_overlap.combine.shapes import parse_shapes  # noqa: E402
from moe_overlap.timing import time_calls  # noqa: E402


def time_ms(fn, rounds):
    """Median ms of ``rounds`` eager calls (the diagnosis is of eager calls, as the layer's
    timeline)."""
    return time_calls(fn, reps=1, replays=rounds, graph=False)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3@16384")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true",
                    help="also the producer at band_group 2..16 x cluster 1 / 2 on the plan, "
                         "fixed and expert-cut groups")
    ap.add_argument("--group-by", default="position", choices=("position", "expert"),
                    help="the layer's producer: fixed groups of 8 or groups cut at experts")
    a = ap.parse_args()
    (s,) = parse_shapes(a.shape)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29518", RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl")  # a one-rank group, as bench_moe_layer alone
    opts, _ = L.parse_options(["--backend", "overlap", "--shapes", a.shape])
    dev = L.Device("cuda")
    data = L.make_inputs(s, 0, 1, opts.dtype, dev.dev, opts.seed)
    gemm_options = {"group_by": "expert"} if a.group_by == "expert" else None
    c = L.MoECombine(s["experts"], s["K"], s["N"], s["topk"], s["tokens"], backend="overlap",
                     validate=False, options=L.CombineOptions(order=opts.order,
                                                              gemm_options=gemm_options))
    ids, _ = L.router(data["x"], data["w_gate"], s["topk"])
    counts = L.count_exchange(ids, s["experts"], None, True)
    plan0 = c.plan(counts, validate=False)
    c.prepare(plan0, ids)
    rt = L.host_routing(counts, 0, s["experts"], int(plan0.total_rows.item()), dev.dev)
    ours = L.OursLayer(s, data, c, dev, rt, False)
    seen = {}

    class Capture:  # records the combine call's arguments, then makes it
        def __getattr__(self, n):
            return getattr(c, n)

        def __call__(self, h, w, plan, ids_, tw, routes=None):
            seen.update(h=h, w=w, plan=plan, ids=ids_, tw=tw, routes=routes)
            return c(h, w, plan, ids_, tw, routes=routes)
    ours.c = Capture()
    with torch.inference_mode():
        ours()
        h, w, plan, routes = seen["h"], seen["w"], seen["plan"], seen["routes"]
        impl = c._impl
        nb = int(plan.num_bands.item())
        rows_e = plan.expert_rows.tolist()
        print(f"{a.shape}: group_by {a.group_by}, ccta {impl.ccta}, mgb {plan.mgb}, tile_m "
              f"{plan.tile_m}, layout "
              f"{plan.layout} (packed {bool(plan.packed.item())}), bands {nb}, rows "
              f"{int(plan.total_rows.item())}, expert rows {min(rows_e)}..{max(rows_e)}, h "
              f"{tuple(h.shape)} {h.stride()}, w {tuple(w.shape)} {w.stride()}", flush=True)
        y, flags = impl.buffers_for(h, plan)
        flop = 2.0 * int(plan.total_rows.item()) * s["K"] * s["N"]
        res = {}
        for cc in sorted({0, impl.ccta}):
            res[f"produce ccta={cc}"] = time_ms(
                lambda cc=cc: impl.produce(h, w, plan, y, flags, ccta=cc), a.rounds)
        for ov in (False, True):
            res[f"forward overlap={ov}"] = time_ms(
                lambda ov=ov: impl.forward(h, w, plan, seen["ids"], seen["tw"], overlap=ov,
                                           routes=routes), a.rounds)
        # balanced bands of the same shape: every expert the same number of whole bands
        E, tm = s["experts"], plan.tile_m
        flops_of = {}
        for per in sorted({max(1, nb // E), max(1, nb // E) + 1}):
            nbb = per * E
            b = torch.arange(nbb, device=dev.dev, dtype=torch.int32)
            hb = h[:nbb * tm] if h.shape[0] >= nbb * tm else torch.randn(
                nbb * tm, s["K"], device=dev.dev).to(torch.bfloat16)
            yb = torch.empty(nbb * tm, s["N"], device=dev.dev, dtype=torch.bfloat16)
            rb = torch.zeros(nbb, dtype=torch.int32, device=dev.dev)
            nbt = torch.tensor([nbb], dtype=torch.int32, device=dev.dev)
            for cc in sorted({0, impl.ccta}):
                key = f"balanced {per} bands/expert ccta={cc}"
                flops_of[key] = 2.0 * nbb * tm * s["K"] * s["N"]
                res[key] = time_ms(
                    lambda cc=cc, b=b, per=per, hb=hb, yb=yb, rb=rb, nbt=nbt: impl._gemm_for(cc)(
                        hb, w, yb, (b // per).to(torch.int32), b * tm, b.clone(), nbt, rb,
                        impl.epoch, ccta=cc), a.rounds)
        if a.sweep:  # the producer's tile order and cluster size on the layer's plan
            from moe_overlap.combine.band_groups import WORKSPACE_TABLES, band_groups
            from moe_overlap.combine.grouped_gemm import GroupedGemm
            valid = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
            starts = plan.band_src_row[plan.schedule[:nb].long()].long()
            valid[(starts[:, None] + torch.arange(plan.tile_m, device=y.device)).reshape(-1)] = 1
            ref = None
            for gb, bgs in (("position", (8, 2, 4, 16)), ("expert", (4, 8, 16))):
                for bg in bgs:
                    for cl in (1, 2):
                        g = GroupedGemm(tile_m=plan.tile_m, tile_n=impl._tile_n, band_group=bg,
                                        cluster_n=cl, group_by=gb)
                        run = (lambda g=g, cc=0: g(
                            h, w, y[:h.shape[0]], plan.band_expert, plan.band_src_row,
                            plan.schedule, plan.num_bands, flags, impl.epoch, ccta=cc))
                        y.fill_(float("nan"))
                        run()
                        if ref is None:  # band_group 8, fixed groups, cluster 1
                            ref = y[valid].clone()
                        same = torch.equal(y[valid].view(torch.int16), ref.view(torch.int16))
                        for cc in sorted({0, impl.ccta}):
                            res[f"plan {gb} band_group={bg} cluster={cl} ccta={cc}"] = time_ms(
                                lambda run=run, cc=cc: run(cc=cc), a.rounds)
                        print(f"  {gb} band_group={bg} cluster={cl}: output bitwise equal to "
                              f"position band_group=8: {same}", flush=True)
            ws = torch.empty(WORKSPACE_TABLES * plan.band_capacity, dtype=torch.int32,
                             device=y.device)
            key = f"band_groups tables alone (G=8, {nb} bands)"
            res[key] = time_ms(lambda: band_groups(plan.schedule, plan.band_expert,
                                                   plan.num_bands, 8, out=ws), a.rounds)
            flops_of[key] = float("nan")
        for k, ms in res.items():
            f = flops_of.get(k, flop)
            print(f"  {k:<36} {ms:8.3f} ms  {f / ms / 1e9:6.0f} TF/s", flush=True)


if __name__ == "__main__":
    main()
