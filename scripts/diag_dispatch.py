"""One call of the overlapped dispatch (MoEDispatch backend="overlap") on W ranks, to locate a
device fault: run with CUDA_LAUNCH_BLOCKING=1 (the failing launch raises) or under
compute-sanitizer (W = 1); W > 1 shares one GPU with MOE_OVERLAP_SHARE_GPU=1 under MPS.

    CUDA_LAUNCH_BLOCKING=1 python scripts/diag_dispatch.py 2

Prints each rank's slot sizes, whether the call finished, bitwise against the reference
backend and the error word."""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))


def one_call(rank, W):
    import torch
    import test_dispatch_overlap_gpu as T
    from moe_overlap import MoEDispatch
    from moe_overlap.combine import exchange_counts
    from moe_overlap.combine.comm_buffer import CommBuffer
    from moe_overlap.combine.plan import plan_combine
    E = T.EL * W
    comm = CommBuffer(None, "nvlink")
    ov = MoEDispatch(E, T.D, T.K, T.T_MAX, backend="overlap", comm_buffer=comm, timeout_s=2.0,
                     validate=False)
    ref = MoEDispatch(E, T.D, T.K, T.T_MAX, backend="reference")
    out = {}
    with torch.no_grad():
        x, ids = T._inputs(rank, W, 70, seed=0)
        counts = exchange_counts(ids, E)
        plan = plan_combine(counts, rank, tile_m=T.TILE_M, layout="aligned")
        torch.cuda.synchronize()
        out["slot_bytes"] = comm.slot_bytes
        out["recv_numel"] = comm.buffers.recv.numel()
        out["layout"] = {k: v for k, v in ov.layout.items()}
        got = ov(x, ids, plan, counts, rows=plan.row_capacity)
        torch.cuda.synchronize()
        out["after_call"] = "ok"
        want = ref(x, ids, plan, counts, rows=plan.row_capacity)
        out["bitwise"] = T._bitwise(got, want)
        out["err"] = [int(v) for v in comm.err.tolist()]
    return out


if __name__ == "__main__":
    from moe_overlap.launch import spawn
    W = int(sys.argv[1])
    try:
        for r in spawn(one_call, W, backend="cuda" if W > 1 else "nccl", join_timeout_s=150,
                       hard_exit=True):
            print(r, flush=True)
    except Exception as e:  # noqa: BLE001
        print("FAILED:", str(e)[-6000:], flush=True)
