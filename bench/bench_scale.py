"""Benchmark of the owner's scale kernel (out[t] = sum_k w[t, k] * row(t, k), bf16 out).

    PYTHONPATH=$PWD python bench/bench_scale.py [--tokens 4096] [--topk 4] [--N 8192] [--out DIR]

One GPU. Inputs as in the combine sweep's shape after the exchange: each token's top-k rows are
distinct rows of the receive buffer (remote picks) or of the producer's output y (local picks,
``y_src`` encoding r < 0), shuffled. The arrival counters are already satisfied, so the kernel's
wait costs one acquire load. Variants: threads, work items per thread per iteration (unroll), CTAs
per SM. Floor: bytes (T * topk * N * 2 read + T * N * 2 written) at 4.8 TB/s. Correctness: every
variant is bitwise equal to the default (same fma order) and close to the float reference. Timing:
CUDA-graph replays (the launch path is host-heavy). JSON with device, date and commit to --out;
a short table last.
"""
import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {  # name: (threads, unroll, ctas_per_sm)
    "t256_u1_c2": (256, 1, 2),  # the default before 2026-11-30
    "t256_u1_c8": (256, 1, 8),
    "t256_u2_c4": (256, 2, 4),
    "t256_u2_c8": (256, 2, 8),
    "t256_u4_c4": (256, 4, 4),
    "t512_u2_c4": (512, 2, 4),
}
HBM_TBS = 4.8


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    from moe_overlap.combine.scale import Scale, scale_torch
    from moe_overlap.provenance import stamp
    from moe_overlap.timing import time_calls
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    T, K, N = a.tokens, a.topk, a.N
    g = torch.Generator(device=dev).manual_seed(0)
    picks = T * K
    n_local = picks // 2
    recv = torch.randn(picks - n_local, N, generator=g, device=dev).to(torch.bfloat16)
    y = torch.randn(n_local, N, generator=g, device=dev).to(torch.bfloat16)
    perm = torch.randperm(picks, generator=g, device=dev)
    # pick p < n_local: local row p of y (encoded -p - 1); else receive row p - n_local
    rows = torch.where(perm < n_local, -perm - 1, perm - n_local).to(torch.int32).view(T, K)
    weights = torch.rand(T, K, generator=g, device=dev)
    counters = torch.zeros(2, dtype=torch.int64, device=dev)
    expected = torch.zeros(2, dtype=torch.int64, device=dev)
    err = torch.zeros(8, dtype=torch.int64, device=dev)
    epoch = torch.zeros(1, dtype=torch.int32, device=dev)
    ref = scale_torch(recv, rows, weights, y=y)
    bytes_moved = picks * N * 2 + T * N * 2
    floor_ms = bytes_moved / (HBM_TBS * 1e12) * 1e3
    rows_out, first = [], None
    for name, (threads, unroll, cps) in VARIANTS.items():
        sc = Scale(K, threads=threads, y_src=True, unroll=unroll, ctas_per_sm=cps)
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)

        def call(sc=sc, out=out):
            sc.launch(recv=recv, rows=rows, weights=weights, out=out, counters=counters,
                      expected=expected, rank=0, err=err, epoch=epoch, slot_bytes=0,
                      num_sms=sms, y=y)
        call()
        torch.cuda.synchronize()
        if int(err[0]) != 0:
            raise RuntimeError(f"{name}: device error {err.tolist()}")
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        first = out.clone() if first is None else first
        ms, mode, _ = time_calls(call, reps=8, replays=a.replays)
        rows_out.append(dict(variant=name, threads=threads, unroll=unroll, ctas_per_sm=cps,
                             ms=ms, timing=mode, TBs=bytes_moved / (ms * 1e-3) / 1e12,
                             rel_err_vs_ref=rel, bitwise_equal_default=bool(torch.equal(out, first))))
    # plain torch for scale: gather + bf16 bmm (the sequential baseline's "bmm" scale)
    src = torch.cat([recv, y])  # row r >= 0 -> r; r < 0 -> len(recv) + (-r - 1)
    idx = torch.where(rows >= 0, rows, recv.shape[0] + (-rows - 1)).long()

    def torch_bmm():
        gathered = src.index_select(0, idx.view(-1)).view(T, K, N)
        return torch.bmm(weights.to(torch.bfloat16).unsqueeze(1), gathered).squeeze(1)
    t_bmm, _, _ = time_calls(torch_bmm, reps=8, replays=a.replays)
    doc = dict(bench="scale", device=torch.cuda.get_device_name(dev),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               git_commit=os.environ.get("GIT_COMMIT", "unknown"), T=T, topk=K, N=N,
               bytes=bytes_moved, floor_ms_at_4p8TBs=floor_ms, torch_gather_bmm_ms=t_bmm,
               variants=rows_out)
    stamp(doc, "scale", gpus=1, device=doc["device"], commit=os.environ.get("GIT_COMMIT", ""))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "scale_bench.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{doc['device']} commit {doc['git_commit'][:10]} T={T} topk={K} N={N} "
          f"floor {floor_ms:.3f} ms, torch gather+bmm {t_bmm:.3f} ms -> {path}")
    print(f"{'variant':>12} {'ms':>7} {'TB/s':>5} {'err':>8} {'bitwise':>7}")
    for r in rows_out:
        print(f"{r['variant']:>12} {r['ms']:7.3f} {r['TBs']:5.2f} {r['rel_err_vs_ref']:8.1e} "
              f"{str(r['bitwise_equal_default']):>7}")


if __name__ == "__main__":
    main()
