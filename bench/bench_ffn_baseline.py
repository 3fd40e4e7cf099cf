"""The compute the chained FFN kernel competes with (issue 17), one GPU: the reference backend's
per-rank work addmm(b1) + in-place act1 + mm on the G = 2 slice of each shape, bf16.

    PYTHONPATH=$PWD python bench/bench_ffn_baseline.py [--tokens 8192,32768] [--out DIR]

Per shape and token count: median ms of CUDA-graph replays (moe_overlap.timing.time_calls, the
method every FFN bench uses), TFLOP/s, the floor at 790 TFLOP/s, and the activation memory of one
call (peak allocation during the call above what was allocated before it, output included: H
[T, O/G], gelu's out-of-place copy and the output for this baseline). JSON
`ffn_baseline_<tag>.json` to --out.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_ffn import SHAPES  # noqa: E402
from bench_results import result_header, write_result  # noqa: E402
from moe_overlap.ffn.activations import activation_  # noqa: E402
from moe_overlap.timing import time_calls  # noqa: E402

PEAK_TFLOPS = 790.0


def ffn_slice(T: int, P: int, hidden: int, device, seed: int):
    """x [T, P], w1 [P, hidden], b1 [hidden], w2 [hidden, P], bf16, random (fixed seed), the
    weights scaled so that every product has unit-size entries."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, P, device=device, dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(P, hidden, device=device, dtype=torch.bfloat16, generator=g) / P ** 0.5
    b1 = torch.randn(hidden, device=device, dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(hidden, P, device=device, dtype=torch.bfloat16, generator=g) / hidden ** 0.5
    return x, w1, b1, w2


def baseline_call(x, w1, b1, w2, act: str):
    """The reference backend's per-rank compute: addmm(b1) + in-place act + mm."""
    return lambda: torch.mm(activation_(torch.addmm(b1, x, w1), act), w2)


def peak_call_bytes(fn) -> int:
    """Peak bytes allocated during one call above what was allocated before it (the output
    included: the same measure for every FFN path, issue 17's `activation_mem`)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del y
    return peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--world", type=int, default=2, help="G: the hidden slice is O / G")
    ap.add_argument("--act", default="gelu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200")
    a = ap.parse_args()
    names = list(SHAPES) if a.shapes == "all" else a.shapes.split(",")
    dev = torch.device("cuda")
    rows = []
    for name in names:
        P, O = SHAPES[name]
        Og = O // a.world
        for T in (int(t) for t in a.tokens.split(",")):
            fn = baseline_call(*ffn_slice(T, P, Og, dev, seed=T), a.act)
            ms = time_calls(fn, reps=5, replays=20)[0]
            flops = 2.0 * T * P * Og * 2
            extra = peak_call_bytes(fn)
            r = dict(shape=name, tokens=T, P=P, hidden_slice=Og, act=a.act, ms=ms,
                     tflops=flops / ms / 1e9, floor_ms=flops / PEAK_TFLOPS / 1e9,
                     activation_mem=extra, h_bytes=T * Og * 2)
            rows.append(r)
            print(f"{name:22s} T={T:6d} {ms:8.3f} ms {r['tflops']:6.1f} TFLOP/s floor "
                  f"{r['floor_ms']:.3f} ms  activation {extra / 2**20:8.1f} MiB", flush=True)
            del fn
    doc = dict(result_header("ffn_baseline"),
               method="CUDA graph of 5 calls, median of 20 replays / 5; activation_mem = peak "
                      "allocation of one eager call above the memory before it (output included)", world=a.world, rows=rows)
    print(f"wrote {write_result(doc, a.out, f'ffn_baseline_{a.tag}.json')}")


if __name__ == "__main__":
    main()
