"""Predicted T_overlap / max(T_gemm, T_comm) with the token-ordered scale (CPU only, no GPU).

    PYTHONPATH=$PWD python bench/predict_ordered_scale.py [--out bench/results/x.json]

For each shape, W = 2, every rank's routing generated as the split bench does (``route(...,
seed=shape index, rank=r)``), the simulator of moe_overlap/combine/ordered_scale.py: today's
scale (after the last arrival and the GEMM), design A (ordered, launched after the producer),
design B (A plus the consumer's CTAs as workers once they have shipped) at several per-SM scale
rates (the rate on few SMs is not measured yet). Synthetic shapes: the GEMM on its SMs, the
consumer's rate and the GEMM on every SM from combine_split_2xh200_v7.json (measured); model
shapes: the cost model of tuning.py (not measured). A table last.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_GBPS = (30.0, 60.0, 100.0)


def name_of(sh):
    return sh.get("name") or "x".join(str(sh[x]) for x in ("tokens", "experts", "topk", "N", "K"))


def main(argv=None):
    import torch

    from moe_overlap.combine.ordered_scale import ScaleModel, simulate
    from moe_overlap.combine.shapes import parse_shapes
    from moe_overlap.routing import route

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default=os.path.join(HERE, "results",
                                                    "combine_split_2xh200_v7.json"))
    ap.add_argument("--models", default="deepseek-v3@4096,qwen3-235b-a22b@4096,"
                                        "qwen3-30b-a3b@4096")
    ap.add_argument("--ccta", default="8,12,16")
    ap.add_argument("--mode", default="balanced")
    ap.add_argument("--tile-tokens", type=int, default=32)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    W, mgb = 2, 2
    with open(args.split) as f:
        split = json.load(f)
    rows = []

    def one(si, sh, ccta, source, **measured):
        T, E, k, N, K = (sh[x] for x in ("tokens", "experts", "topk", "N", "K"))
        ids = [route(T, E, k, args.mode, seed=si, rank=r)[0] for r in range(W)]
        counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
        r = {"shape": sh, "ccta": ccta, "rates": source}
        for g in WORKER_GBPS:
            m = ScaleModel(worker_gbps_per_sm=g, **measured)
            p = simulate(ids, counts, N, K, ccta, mgb=mgb, tile_tokens=args.tile_tokens,
                         model=m)
            if g == WORKER_GBPS[0]:
                r.update({x: p[x] for x in ("bound", "today", "today_over_bound", "A",
                                            "A_over_bound", "gemm_end", "ship_end",
                                            "scale_full", "tiles", "deps_per_tile")})
            r[f"B_{int(g)}"] = p["B"]
            r[f"B_{int(g)}_over_bound"] = p["B_over_bound"]
        rows.append(r)
        print(f"{name_of(sh)} ccta {ccta} ({source}): bound {r['bound']:.3f} today {r['today_over_bound']:.2f}"
              f" A {r['A_over_bound']:.2f} B " + " / ".join(
                  f"{r[f'B_{int(g)}_over_bound']:.2f}" for g in WORKER_GBPS), flush=True)

    shapes = []  # the split bench seeds each shape's routing with its index
    for p in split["points"]:
        if p["shape"] not in shapes:
            shapes.append(p["shape"])
        one(shapes.index(p["shape"]), p["shape"], p["ccta"], "measured v7",
            gemm_ms=p["gemm_prod"], ship_gbps=p["remote_GBs_ship"], gemm_all_ms=p["gemm_all"],
            begin_us=p["begin"] * 1e3)
    for si, sh in enumerate(parse_shapes(args.models)):
        for c in (int(x) for x in args.ccta.split(",")):
            one(si, sh, c, "cost model")
    print("\n| shape | ccta | rates | bound ms | today | A | B @30 / 60 / 100 GB/s per SM |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {name_of(r['shape'])} | {r['ccta']} | {r['rates']} | {r['bound']:.3f} | "
              f"{r['today_over_bound']:.2f} | {r['A_over_bound']:.2f} | " + " / ".join(
                  f"{r[f'B_{int(g)}_over_bound']:.2f}" for g in WORKER_GBPS) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": {"mode": args.mode, "world_size": W, "mgb": mgb,
                                "tile_tokens": args.tile_tokens, "split": args.split,
                                "worker_gbps_per_sm": WORKER_GBPS}, "points": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
