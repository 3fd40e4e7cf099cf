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
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_ffn import SHAPES  # noqa: E402
from moe_overlap.ffn.activations import activation_  # noqa: E402
from moe_overlap.timing import time_calls  # noqa: E402

PEAK_TFLOPS = 790.0


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
            g = torch.Generator(device=dev).manual_seed(T)
            x = torch.randn(T, P, device=dev, dtype=torch.bfloat16, generator=g)
            w1 = torch.randn(P, Og, device=dev, dtype=torch.bfloat16, generator=g) / P ** 0.5
            b1 = torch.randn(Og, device=dev, dtype=torch.bfloat16, generator=g)
            w2 = torch.randn(Og, P, device=dev, dtype=torch.bfloat16, generator=g) / Og ** 0.5

            def fn():
                return torch.mm(activation_(torch.addmm(b1, x, w1), a.act), w2)

            ms = time_calls(fn, reps=5, replays=20)[0]
            flops = 2.0 * T * P * Og * 2
            extra = peak_call_bytes(fn)
            r = dict(shape=name, tokens=T, P=P, hidden_slice=Og, act=a.act, ms=ms,
                     tflops=flops / ms / 1e9, floor_ms=flops / PEAK_TFLOPS / 1e9,
                     activation_mem=extra, h_bytes=T * Og * 2)
            rows.append(r)
            print(f"{name:22s} T={T:6d} {ms:8.3f} ms {r['tflops']:6.1f} TFLOP/s floor "
                  f"{r['floor_ms']:.3f} ms  activation {extra / 2**20:8.1f} MiB", flush=True)
            del x, w1, b1, w2
    doc = dict(bench="ffn_baseline", device=torch.cuda.get_device_name(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               git_commit=os.environ.get("GIT_COMMIT", "unknown"), torch=torch.__version__,
               method="CUDA graph of 5 calls, median of 20 replays / 5; activation_mem = peak "
                      "allocation of one eager call above the memory before it (output included)", world=a.world, rows=rows)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"ffn_baseline_{a.tag}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
