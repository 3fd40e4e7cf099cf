"""The overlapped dispatch's send and expand on one GPU, every rank of a W-rank group in this
process (a lab probe: the kernels' own rates, not the layer's).

    python bench/lab_dispatch_inproc.py --model deepseek-v3 --world 8 --tokens 4096 --out $OUT

Why: the layer projection takes the expand's copy rate per SM as an assumption (the scale
kernel's HBM rate / 132) and the send's as the consumer's; neither kernel has been timed. Here
W MoEDispatch(backend="overlap") layers, one per rank, share this process and GPU: a stand-in
runtime gives every rank's CommBuffer plain device memory and peer tables of the other ranks'
addresses (the nvlink transport's stores are then local stores), and the kernel launches are
queued per rank and run as the GPU orders them across ranks (every send, then every owner's
expand), as tests/test_dispatch_overlap_launch_emulated.py runs them on the emulator. Checked:
every rank's output bitwise the plan layout by definition (rows of each (expert, source) group
in (token, k) order, zero elsewhere), every error word 0, every band flag raised.

Then rank 0's recorded launches are replayed alone in CUDA graphs, timed with
moe_overlap.timing.time_interleaved: the expand (every source already landed) at several grid
sizes (its CTAs, 2 per SM in the layer) and the send, each built with the module's COPY_UNROLL
and with 1 (one 16-byte load in flight per thread: the latency-bound copy), the expand's
outputs bitwise equal. Rates: bytes moved (the expand: valid rows read, every output row
written; the send: each (token, owner) row read and stored) per second and per CTA.
On one GPU the send's peer stores are local: its NVLink rate is not measured here.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_results import result_header, write_result  # noqa: E402


class World:
    """Every in-process rank's allocations (index i of each rank is one allocation)."""

    def __init__(self, W: int, device):
        self.W, self.device = W, device
        self.allocs = [[] for _ in range(W)]
        self.tables = []  # (rank, allocation index, int64 [W] table)

    def fill_tables(self):
        for r, i, table in self.tables:
            table.copy_(torch.tensor([self.allocs[pe][i].data_ptr() for pe in range(self.W)]))


class Runtime:
    """The NvshmemRuntime surface CommBuffer uses, on this process's GPU."""

    def __init__(self, world: World, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.W
        self.device = world.device

    def alloc(self, shape, dtype, note=""):
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        self.world.allocs[self.rank].append(t)
        return t

    def free(self, t):
        raise RuntimeError("the lab sizes every buffer at its first attach")

    def peer_table(self, t):
        i = next(i for i, a in enumerate(self.world.allocs[self.rank]) if a is t)
        table = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        self.world.tables.append((self.rank, i, table))
        return table, ()

    def barrier(self, what=""):
        pass


class Queue:
    """Stands in for LaunchCache: the launches of ``recording`` ranks are queued as (rank, kind,
    launcher, ints) instead of run; others (warm-ups) run at once."""

    def __init__(self, real_cache):
        self.real, self.items, self.rank, self.kind, self.recording = real_cache, [], 0, "", False

    def cache(self, fn):
        launcher = self.real(fn)

        def call(ints, stream_handle):
            if not self.recording:
                return launcher(ints, stream_handle)
            self.items.append((self.rank, self.kind, launcher, tuple(int(v) for v in ints)))
        return call

    def run(self, stream):
        for _, kind, launcher, ints in sorted(self.items, key=lambda q: (q[1] != "send", q[0])):
            launcher(ints, stream.cuda_stream)
        done, self.items = self.items, []
        return done


def _stream() -> int:
    """The current stream's handle, read at each launch (a graph capture has its own)."""
    return torch.cuda.current_stream().cuda_stream


def expected_rows(xs, ids, plan, counts, rank, rows, El, D, K):
    """Owner ``rank``'s plan-layout rows from the definition: each (expert, source) group's
    tokens in (token, k) order at expert_row_start[e] + group_row_start[e, s]; zero elsewhere."""
    out = torch.zeros(rows, D, dtype=torch.bfloat16, device=xs[0].device)
    ers, grs = plan.expert_row_start.tolist(), plan.group_row_start.tolist()
    for s, (x, i) in enumerate(zip(xs, ids)):
        flat = i.reshape(-1)
        for e in range(El):
            g = rank * El + e
            pos = (flat == g).nonzero().flatten()  # (token, k) order
            assert pos.numel() == int(counts[s, g])
            a = ers[e] + grs[e][s]
            out[a:a + pos.numel()] = x[pos // K]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--grids", default="16,24,32,264",
                    help="expand CTAs to time (the layer: 2 per SM it leaves the dispatch)")
    ap.add_argument("--send-ctas", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import moe_overlap.combine.dispatch_dedup as DD
    import moe_overlap.combine.dispatch_expand as DE
    import moe_overlap.combine.dispatch_send as DS
    import moe_overlap.kernels.primitives as P
    from moe_overlap import timing
    from moe_overlap.combine.comm_buffer import CommBuffer
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.combine.projection_layer import draw_ids
    from moe_overlap.combine.shapes import MODELS
    E, K, _, D = MODELS[a.model]
    W, T, dev = a.world, a.tokens, torch.device("cuda", 0)
    El = E // W
    S = torch.cuda.get_device_properties(dev).multi_processor_count
    q = Queue(P.LaunchCache)
    P.LaunchCache = q.cache  # the launch wrappers import it from the module at call time
    for cls, kind in ((DS.DispatchSend, "send"), (DE.DispatchExpand, "expand")):
        real = cls.launch

        def launch(self, *args, _real=real, _kind=kind, **kw):
            q.kind = _kind
            return _real(self, *args, **kw)
        cls.launch = launch
    cur = {"rank": 0}
    DD.world = lambda group: (cur["rank"], W)
    world = World(W, dev)
    layers = []
    for r in range(W):
        cur["rank"] = r
        comm = CommBuffer(None, "nvlink", runtime=Runtime(world, r))
        layers.append(DD.MoEDispatch(E, D, K, T, backend="overlap", comm_buffer=comm,
                                     send_ctas=a.send_ctas, timeout_s=5.0, validate=False,
                                     signal_arrival=True, expand_wait="per_source"))
    world.fill_tables()
    for lay in layers[1:]:  # one compiled send and expand for every rank (its ints differ)
        lay.sender, lay.expander = layers[0].sender, layers[0].expander
    ids = [i.to(dev) for i in draw_ids(a.model, W, T, a.routing, seed=0)]
    g = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(W)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plans = [plan_combine(counts, r, tile_m=128, layout="packed") for r in range(W)]
    stream = torch.cuda.current_stream(dev)
    with torch.no_grad():
        for r in range(W):  # warm-ups run at once (no effect), outside the recording
            cur["rank"] = q.rank = r
            layers[r]._warmup()
        q.recording = True
        outs = []
        for r in range(W):
            cur["rank"] = q.rank = r
            # poisoned slots: every row the expand reads must have been sent
            layers[r].comm.buffers.recv.fill_(float("nan"))
            outs.append(layers[r](xs[r], ids[r], plans[r], counts,
                                  rows=plans[r].row_capacity))
        q.recording = False
        done = q.run(stream)
        torch.cuda.synchronize()
    correct = True
    for r in range(W):
        err = [int(v) for v in layers[r].comm.err.tolist()]
        want = expected_rows(xs, ids, plans[r], counts, r, plans[r].row_capacity, El, D, K)
        same = torch.equal(outs[r].view(torch.int16), want.view(torch.int16))
        nb = int(plans[r].num_bands)
        flags = bool((layers[r].band_arrived[:nb] == layers[r].comm.epoch).all())
        print(f"rank {r}: rows bitwise {same}, error word {err}, band flags {flags}", flush=True)
        correct = correct and same and not any(err) and flags
    # ---- rank 0's own launches, replayed alone -------------------------------------------
    send0 = next(x for x in done if x[0] == 0 and x[1] == "send")
    exp0 = next(x for x in done if x[0] == 0 and x[1] == "expand")
    plan0 = plans[0]
    valid = int(plan0.valid_rows)
    rows = plan0.row_capacity  # the output's rows: every one written (tokens, padding, zeros)
    row_bytes = 2 * D
    exp_bytes = (valid + rows) * row_bytes  # the valid rows read, every output row written
    dest = (ids[0] // El)  # [T, K] owner ranks of rank 0's tokens
    per_dest = torch.zeros(T, W, dtype=torch.bool, device=dev).scatter_(1, dest, True)
    send_bytes = 2 * int(per_dest.sum()) * row_bytes  # every (token, owner) row read + stored

    def kernels(unroll: int):
        """(send, expand) launchers of the layers' options, both copies at ``unroll`` vectors
        in flight (the modules' COPY_UNROLL is read when the kernels are built)."""
        old = DS.COPY_UNROLL, DE.COPY_UNROLL
        DS.COPY_UNROLL = DE.COPY_UNROLL = unroll
        try:
            objs = DD.MoEDispatch.overlap_kernels(W, K, a.send_ctas, 5.0, True, "per_source")
            return tuple(q.real(o.compile()) for o in objs)
        finally:
            DS.COPY_UNROLL, DE.COPY_UNROLL = old

    U_E, U_S = DE.COPY_UNROLL, DS.COPY_UNROLL
    fns, meta = {}, {}  # name -> the launch; name -> (bytes moved, CTAs)
    grids = [int(v) for v in a.grids.split(",") if v]
    for u in sorted({1, U_E, U_S}):
        send_ln, exp_ln = kernels(u)
        if u in (1, U_S):
            fns[f"send_u{u}"] = (lambda ln=send_ln, it=send0[3]: ln(it, _stream()))
            meta[f"send_u{u}"] = (send_bytes, a.send_ctas)
        if u in (1, U_E):
            for gr in grids:
                ctas = min(gr, El * W + 1)
                it = exp0[3][:-1] + (ctas,)  # the launcher's last int is the grid
                fns[f"expand_u{u}_g{gr}"] = (lambda ln=exp_ln, it=it: ln(it, _stream()))
                meta[f"expand_u{u}_g{gr}"] = (exp_bytes, ctas)
    # every variant's expand output bitwise the first's (the replays rewrite rank 0's rows)
    out0 = outs[0]
    first = out0.clone()
    for name, f in fns.items():
        if name.startswith("expand"):
            out0.fill_(float("nan"))
            f()
            torch.cuda.synchronize()
            ok = torch.equal(out0.view(torch.int16), first.view(torch.int16))
            print(f"{name}: output bitwise the recorded call's: {ok}", flush=True)
            correct = correct and ok
    graphs = {k: timing.graphed(f) for k, f in fns.items()}
    t = timing.time_interleaved({k: gr.replay for k, gr in graphs.items()}, rounds=a.rounds,
                                lead_ms=1.0, shuffle_seed=0)
    res = {}
    for name, (nbytes, ctas) in meta.items():
        ms = t[name]["median_ms"]
        res[name] = dict(ms=ms, gbps=nbytes / ms / 1e6, ctas=ctas,
                         gbps_per_cta=nbytes / ms / 1e6 / ctas)
        print(f"{name:<22} {ms:8.3f} ms {res[name]['gbps']:8.1f} GB/s on {ctas:3d} CTAs "
              f"({res[name]['gbps_per_cta']:.1f} GB/s per CTA)", flush=True)
    doc = dict(result_header("lab_dispatch_inproc"), model=a.model, world_size=W, tokens=T,
               routing=a.routing, num_sms=S, rows=rows, valid_rows=valid, row_bytes=row_bytes,
               expand_bytes=exp_bytes, send_bytes=send_bytes, copy_unroll=dict(
                   expand=U_E, send=U_S), rounds=a.rounds, correct=correct, results=res,
               method=__doc__.split("\n\n")[1].replace("\n", " "))
    if a.out:
        name = f"lab_dispatch_inproc_{a.model}_w{W}_t{T}.json"
        print("wrote", write_result(doc, a.out, name))
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
