"""One call of the overlapped dispatch (MoEDispatch backend="overlap") on W ranks, to locate a
device fault: run with CUDA_LAUNCH_BLOCKING=1 (the failing launch raises) or under
compute-sanitizer (W = 1); W > 1 shares one GPU with MOE_OVERLAP_SHARE_GPU=1 under MPS.

    CUDA_LAUNCH_BLOCKING=1 python scripts/diag_dispatch.py 2 [zero]

Prints each rank's addresses and peer tables before the call (a fault kills the process), then
its slot sizes, whether the call finished, bitwise against the reference backend and the error
word. ``zero``: rank 1 routes no tokens (its x / ids at address 0), the GPU test's first case;
without it every rank routes 70."""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))


def one_call(rank, W, zero_rank=None):
    import faulthandler
    import torch
    if os.environ.get("DIAG_DUMP_S"):  # a hang prints every thread's stack, then exits
        faulthandler.dump_traceback_later(float(os.environ["DIAG_DUMP_S"]), exit=True)
    import test_dispatch_overlap_gpu as T
    from moe_overlap import MoEDispatch
    from moe_overlap.combine import exchange_counts
    from moe_overlap.combine.comm_buffer import CommBuffer
    from moe_overlap.combine.plan import plan_combine
    E = T.EL * W
    comm = CommBuffer(None, "nvlink")
    # DIAG_PER_SOURCE: the layer's expand (items waiting per source, band flags), as the GPU
    # test's `ps`
    ps = dict(signal_arrival=True, expand_wait="per_source", expand_ctas=4) \
        if os.environ.get("DIAG_PER_SOURCE") else {}
    ov = MoEDispatch(E, T.D, T.K, T.T_MAX, backend="overlap", comm_buffer=comm, timeout_s=2.0,
                     validate=False, **ps)
    ref = MoEDispatch(E, T.D, T.K, T.T_MAX, backend="reference")
    out = {}
    with torch.no_grad():
        x, ids = T._inputs(rank, W, 0 if rank == zero_rank else 70, seed=0)
        counts = exchange_counts(ids, E)
        plan = plan_combine(counts, rank, tile_m=T.TILE_M, layout="aligned",
                            max_rows=W * T.T_MAX * T.K)
        torch.cuda.synchronize()
        out["slot_bytes"] = comm.slot_bytes
        out["recv_numel"] = comm.buffers.recv.numel()
        out["layout"] = {k: v for k, v in ov.layout.items()}
        # printed now: a fault kills the process before its result comes back
        b = comm.buffers
        print(f"rank {rank}: tokens {x.shape[0]} x@{x.data_ptr():#x} ids@{ids.data_ptr():#x}; "
              f"recv {b.recv.data_ptr():#x}+{b.recv.numel() * 2} block "
              f"{b.block.data_ptr():#x}+{b.block.numel() * 8} err {comm.err.data_ptr():#x}; "
              f"recv_peers {[hex(v) for v in b.recv_peers.tolist()]} ctr_peers "
              f"{[hex(v) for v in b.ctr_peers.tolist()]} err_peers "
              f"{[hex(v) for v in comm.err_peers.tolist()]}; rows {plan.row_capacity}, "
              f"total {int(plan.total_rows)}, sms {ov.num_sms}", flush=True)
        if os.environ.get("DIAG_STAGES"):  # the call's launches one at a time, synchronized
            got = staged_call(ov, comm, x, ids, plan, counts, rank)
        else:
            got = ov(x, ids, plan, counts, rows=plan.row_capacity)
        torch.cuda.synchronize()
        out["after_call"] = "ok"
        want = ref(x, ids, plan, counts, rows=plan.row_capacity)
        out["bitwise"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        out["err"] = [int(v) for v in comm.err.tolist()]
        if not out["bitwise"]:  # where: the differing rows, what they hold, the plan
            bad = (got.view(torch.int16) != want.view(torch.int16)).any(1).nonzero().flatten()
            out["diff_rows"] = [len(bad)] + bad[:12].tolist() + bad[-4:].tolist()
            out["diff_got_nan"] = bool(torch.isnan(got[bad].float()).all())
            out["diff_want_zero"] = bool((want[bad] == 0).all())
            out["plan"] = {n: getattr(plan, n).tolist() for n in (
                "expert_row_start", "expert_rows", "group_row_start", "total_rows")}
    return out


def staged_call(ov, comm, x, ids, plan, counts, rank):
    """MoEDispatch._forward_overlap's launches with a synchronize and a barrier after each (the
    rank and stage printed), so the launch that faults is named, and on which rank."""
    import torch
    import torch.distributed as dist

    def stage(name):
        torch.cuda.synchronize()
        print(f"rank {rank}: {name} done", flush=True)
        dist.barrier()

    dev = comm.runtime.device
    ids32 = ids.to(torch.int32).contiguous()
    cnt = counts.to(dev, torch.int64).contiguous()
    rows = plan.row_capacity
    out = torch.full((rows, ov.hidden_size), float("nan"), dtype=torch.bfloat16, device=dev)
    ov.sender.compile()
    ov.expander.compile()
    stage("compile")
    comm.note_call()
    comm.epoch.add_(1)
    comm.expected.add_(ov.send_ctas)
    stage("epoch")
    b = comm.buffers
    ov.sender.launch(x=x.contiguous(), ids=ids32, experts_per_rank=ov.experts_per_rank,
                     rank=ov.rank, max_tokens=ov.max_tokens_per_rank, recv_peers=b.recv_peers,
                     ctr_peers=b.ctr_peers, layout=ov.layout, slot_stride=comm.slot_bytes,
                     epoch=comm.epoch, fingerprint=plan.counts_fingerprint, err=comm.err)
    stage("send")
    print(f"rank {rank}: counters {b.counters.tolist()} expected {comm.expected.tolist()} "
          f"block {b.block.tolist()}", flush=True)
    ov.expander.launch(recv=b.recv, slot_stride=comm.slot_bytes, layout=ov.layout,
                       max_tokens=ov.max_tokens_per_rank, out=out, plan=plan, counts=cnt,
                       err=comm.err, epoch=comm.epoch, counters=b.counters,
                       expected=comm.expected, err_peers=comm.err_peers, num_sms=ov.num_sms,
                       tile_m=plan.tile_m, arr_count=ov._expand_state(plan),
                       band_arrived=ov.arrival_flags(plan) if ov.signal_arrival else None)
    stage("wait + expand")
    return out


if __name__ == "__main__":
    from moe_overlap.launch import spawn
    W = int(sys.argv[1])
    # "zero": rank 1 routes no tokens (tests/test_dispatch_overlap_gpu.py's first case)
    zero = 1 if len(sys.argv) > 2 and sys.argv[2] == "zero" and W > 1 else None
    try:
        for r in spawn(one_call, W, zero, backend="cuda" if W > 1 else "nccl", join_timeout_s=150,
                       hard_exit=True):
            print(r, flush=True)
    except Exception as e:  # noqa: BLE001
        print("FAILED:", str(e)[-6000:], flush=True)
