"""Consumer bandwidth vs SM count (ccta) and transfer size, 2 GPUs (both ranks ship at once).

    torchrun --nproc-per-node 2 bench/bench_consumer.py [--quick]
    (or python bench/bench_consumer.py, which spawns 2 ranks itself)

Variants: thread copies (nvlink, threads x unroll), nvshmem put_signal, and copy="tma" (bulk
copies through a shared-memory ring, stages x chunk; BENCH_TMA_ONLY=1 times only those next to
the v1 default). Each rank ships S bytes to the other (S = rows * N * 2, N = 4096) as segments of
min(tile_m, ceil(rows / ccta)) rows with every band flag preset (data ready): this measures the
shipping alone. Timing: CUDA events around `iters` back-to-back consumer launches after a barrier;
GB/s = S / time per launch (one direction; both directions run at the same time). Baseline: a
peer-to-peer torch copy_ of S bytes (the copy engine). JSON to $OUT (or bench/results), the short
table printed last.
"""
import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

N = 4096
ROW_BYTES = N * 2
TILE_M = 128


def make_plan(rank, W, rows, ccta, dev):
    """Synthetic plan: `rows` rows of y to the next rank, segments of seg rows, 1 band each."""
    seg = max(1, min(TILE_M, math.ceil(rows / ccta)))
    nseg = math.ceil(rows / seg)
    dest = (rank + 1) % W
    starts = list(range(0, rows, seg))
    sizes = [min(seg, rows - s) for s in starts]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)
    return SimpleNamespace(
        rank=rank, world_size=W,
        num_segments=i32([nseg]), segment_start=i32(list(range(nseg))),
        segment_bands=i32([1] * nseg), segment_dest=i32([dest] * nseg),
        segment_src_row=i32(starts), segment_dest_row=i32(starts), segment_rows=i32(sizes),
        schedule=i32(list(range(nseg))), num_local_cells=i32([0]), local_cell_band=i32([-1]),
        local_cell_src_row=i32([-1]), local_cell_rows=i32([-1]), local_cell_dest_row=i32([-1]),
        band_capacity=nseg)


def bench(args):
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    from moe_overlap.runtime.nvshmem import NvshmemRuntime
    from moe_overlap.combine.consumer import Consumer
    rt = NvshmemRuntime.get()
    sizes = [32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20]
    cctas = [2, 4, 8, 16, 32]
    if args.sizes:
        sizes = [int(float(v) * (1 << 20)) // ROW_BYTES * ROW_BYTES for v in args.sizes.split(",")]
    if args.cctas:
        cctas = [int(v) for v in args.cctas.split(",")]
    # (transport, threads, unroll, options); copy="tma": bulk copies through a smem ring of
    # stages x chunk_bytes (threads / unroll unused there)
    variants = [("nvlink", 512, 4, {}), ("nvlink", 512, 8, {}), ("nvlink", 1024, 4, {}),
                ("nvlink", 1024, 8, {}), ("nvshmem", 512, 1, {}),
                ("nvlink", 32, 1, dict(copy="tma")),
                ("nvlink", 32, 1, dict(copy="tma", stages=6, chunk_bytes=32768, lookahead=2)),
                ("nvlink", 32, 1, dict(copy="tma", stages=24, chunk_bytes=8192, lookahead=8)),
                ("nvlink", 32, 1, dict(copy="tma", stages=8, chunk_bytes=16384, lookahead=2))]
    if os.environ.get("BENCH_TMA_ONLY") == "1":
        variants = [variants[0]] + [v for v in variants if v[3].get("copy") == "tma"]
    if args.tma:  # only these ring shapes, e.g. "12x16K_l4,12x16K_l8": stages x chunk, lookahead
        variants = [("nvlink", 32, 1, dict(copy="tma", stages=int(v.split("x")[0]),
                                           chunk_bytes=int(v.split("x")[1].split("K")[0]) << 10,
                                           lookahead=int(v.split("_l")[1])))
                    for v in args.tma.split(",")]
    if args.quick:
        sizes, cctas = [8 << 20], [8, 16]
        variants = [variants[0], next(v for v in variants if v[3].get("copy") == "tma")]
    max_rows = max(sizes) // ROW_BYTES
    buf = rt.buffers(max_rows, N, key="bench")
    y = torch.randn(max_rows, N, device=dev).to(torch.bfloat16)
    epoch = torch.ones(1, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int64, device=dev)
    results = []
    # copy-engine baseline: y -> peer's receive buffer
    peer = rt.peer_tensor(buf.recv, (rank + 1) % W)
    for S in sizes:
        r = S // ROW_BYTES
        for _ in range(3):
            peer[:r].copy_(y[:r])
        rt.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.iters):
            peer[:r].copy_(y[:r])
        e1.record()
        torch.cuda.synchronize()
        t = e0.elapsed_time(e1) / args.iters * 1e-3
        results.append(dict(variant="copy_engine", ccta=0, bytes=S, us=t * 1e6, gbps=S / t / 1e9))
    for tr, threads, unroll, opts in variants:
        cons = Consumer(tr, threads, unroll, timeout_ns=5_000_000_000, **opts)
        cons.compile()
        if opts.get("copy") == "tma":
            o = cons.options
            name = f"{tr}_tma_s{o['stages']}x{o['chunk_bytes'] >> 10}K_l{o['lookahead']}"
        else:
            name = f"{tr}_t{threads}_u{unroll}"
        for ccta in cctas:
            for S in sizes:
                rows = S // ROW_BYTES
                plan = make_plan(rank, W, rows, ccta, dev)
                ready = torch.ones(plan.band_capacity, dtype=torch.int32, device=dev)
                launch = lambda: cons.launch(y=y, plan=plan, band_ready=ready, epoch=epoch,
                                             recv_peers=buf.recv_peers, ctr_peers=buf.ctr_peers,
                                             recv_sym=buf.recv.data_ptr(),
                                             ctr_sym=buf.counters.data_ptr(), err=err,
                                             ccta=ccta, slot_bytes=0)
                for _ in range(3):
                    launch()
                rt.barrier()
                # eager: host-bound for small sizes (Python launch cost of the CuTe call)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(args.iters):
                    launch()
                e1.record()
                torch.cuda.synchronize()
                t_eager = e0.elapsed_time(e1) / args.iters * 1e-3
                # CUDA graph of `iters` launches: device time per launch
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(args.iters):
                        launch()
                g.replay()
                torch.cuda.synchronize()
                rt.barrier()
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize()
                t = e0.elapsed_time(e1) / args.iters * 1e-3
                results.append(dict(variant=name, ccta=ccta, bytes=S, us=t * 1e6,
                                    gbps=S / t / 1e9, segments=int(plan.band_capacity),
                                    eager_us=t_eager * 1e6))
        if int(err[0].item()) != 0:
            raise RuntimeError(f"device error {err.tolist()}")
    # correctness spot check of the last variant run: receive == sender's y
    rt.barrier()
    # receive rows == the previous rank's y (the last variant shipped all max_rows): checksums
    ys = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(W)]
    dist.all_gather(ys, y.double().sum().reshape(1))
    got = buf.recv[:max_rows].double().sum()
    ok = bool(torch.isclose(got, ys[(rank - 1) % W][0], rtol=0, atol=1e-6))
    return results, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sizes", default="", help="transfer sizes in MiB (default 32 KiB .. 8 MiB)")
    ap.add_argument("--cctas", default="", help="SM counts (default 2,4,8,16,32)")
    ap.add_argument("--n", type=int, default=N, help="row width in bf16 elements")
    ap.add_argument("--tma", default="", help="only TMA rings STAGESxCHUNK_lLOOKAHEAD, e.g. "
                                              "12x16K_l4,12x16K_l8 (copy engine always timed)")
    args = ap.parse_args()
    if "RANK" not in os.environ:  # spawn 2 ranks ourselves
        import torch.multiprocessing as mp
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
        mp.spawn(_entry, args=(args,), nprocs=2)
        return
    _entry(int(os.environ["RANK"]), args)


def _entry(rank, args):
    global N, ROW_BYTES
    N, ROW_BYTES = args.n, args.n * 2  # (spawned ranks import the module afresh)
    os.environ["RANK"] = str(rank)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    t0 = time.time()
    results, ok = bench(args)
    if rank == 0:
        out = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
        os.makedirs(out, exist_ok=True)
        import datetime
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, N=N,
                    correct=ok, seconds=time.time() - t0,
                    git_commit=os.environ.get("GIT_COMMIT", ""),
                    date=datetime.date.today().isoformat())
        from moe_overlap.provenance import stamp
        doc = stamp(dict(meta=meta, results=results), "consumer", gpus=dist.get_world_size(),
                    device=meta["device"], commit=meta["git_commit"])
        with open(os.path.join(out, "consumer_bench.json"), "w") as f:
            json.dump(doc, f, indent=1)
        print(f"consumer bench: {meta}")
        variants = sorted({r["variant"] for r in results}, key=lambda v: (v != "copy_engine", v))
        sizes = sorted({r["bytes"] for r in results})
        eag = [r["eager_us"] for r in results if "eager_us" in r]
        if eag:
            print(f"eager launch-to-launch time (host-bound below ~{min(eag):.0f} us): "
                  f"min {min(eag):.1f} us, median {sorted(eag)[len(eag) // 2]:.1f} us")
        print("GB/s per direction (both directions at once, CUDA-graph timed); "
              "rows: variant@ccta, cols: bytes")
        print("variant@ccta".ljust(28) + "".join(f"{s >> 10:>9}K" for s in sizes))
        for v in variants:
            for c in sorted({r["ccta"] for r in results if r["variant"] == v}):
                row = {r["bytes"]: r["gbps"] for r in results if r["variant"] == v and r["ccta"] == c}
                print(f"{v}@{c}".ljust(28) + "".join(f"{row.get(s, float('nan')):>10.1f}"
                                                      for s in sizes))
        print(f"correct: {ok}")
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
