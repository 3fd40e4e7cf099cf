"""Step-by-step probe of the overlapped combine on GPU ranks (moe_overlap.launch backend="cuda"):
each step synchronizes and prints, so a fault names the step that caused it. Diagnostic only.

    python scripts/ranks_probe.py [W] [transport] [layout]
"""
import sys
import time


def say(rank, msg):
    print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def worker(rank, world, transport, layout):
    import torch
    from moe_overlap.launch import rank_device
    dev = rank_device()
    try:
        from cuda.bindings import driver as drv
        torch.zeros(1, device=dev)
        err, aff = drv.cuCtxGetExecAffinity(drv.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT)
        say(rank, f"exec affinity: {err} sm_count={getattr(aff.param.smCount, 'val', None)}")
    except Exception as e:  # noqa: BLE001
        say(rank, f"exec affinity unavailable: {e}")
    say(rank, f"props sms={torch.cuda.get_device_properties(dev).multi_processor_count}")
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.combine.overlap import OverlapCombine
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.routing import route
    E, k, K, N, T = 8, 2, 256, 512, 384
    ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N, topk=k,
                        max_tokens_per_rank=T, tile_m=128, ccta=8, transport=transport,
                        timeout_s=10.0)
    say(rank, f"OverlapCombine built: num_sms={ov.num_sms} producer={ov.producer_kind}")
    ids, w = route(200 + 37 * rank, E, k, mode="moderate_skew", seed=3, rank=rank, device=dev)
    counts = exchange_counts(ids, E)
    plan = plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=world * T * k, layout=layout)
    torch.cuda.synchronize()
    say(rank, f"plan: {plan.counts()}")
    ov.warmup()
    torch.cuda.synchronize()
    say(rank, "warmup done")
    y = torch.randn(plan.row_capacity + 1, N, device=dev).to(torch.bfloat16)
    band_ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=dev)
    ov.rt.barrier()
    ov.begin_call(ids, w)
    torch.cuda.synchronize()
    say(rank, f"begin_call done, epoch {int(ov.epoch)}")
    band_ready.copy_(torch.where(torch.arange(plan.band_capacity, device=dev) < plan.num_bands,
                                 ov.epoch.expand(plan.band_capacity), band_ready))
    ov.ship(y, plan, band_ready)
    torch.cuda.synchronize()
    say(rank, "ship (consumer alone) done")
    ov.check_errors()
    ov.rt.barrier()
    g = torch.Generator(device=dev).manual_seed(rank)
    h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(E // world, K, N, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
    out = ov.forward(h, wd, plan, ids, w, check=True, overlap=False)
    torch.cuda.synchronize()
    say(rank, f"forward overlap=False done: finite={bool(torch.isfinite(out).all())}")
    ov.rt.barrier()
    out2 = ov.forward(h, wd, plan, ids, w, check=True)
    torch.cuda.synchronize()
    say(rank, f"forward overlapped done: equal={bool(torch.equal(out, out2))}")
    ov.rt.barrier()
    return True


if __name__ == "__main__":
    from moe_overlap.launch import spawn
    W = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    tr = sys.argv[2] if len(sys.argv) > 2 else "nvlink"
    lay = sys.argv[3] if len(sys.argv) > 3 else "auto"
    print(spawn(worker, W, tr, lay, backend="cuda", join_timeout_s=240, hard_exit=True))
