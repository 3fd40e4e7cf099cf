"""One MoE layer end to end, ours (MoECombine) against the same-scale sequential layer.

    torchrun --nproc-per-node 2 bench/bench_moe_layer.py --shapes models --tokens 4096,16384 \
        --out DIR
    python bench/bench_moe_layer.py --device cpu --backend reference --spawn 2 --shapes 64x8x2x32x16

Both layers run router -> count exchange -> dispatch (NCCL / gloo all-to-all) -> up-projection
(grouped GEMM + SwiGLU) -> combine (down-projection, return all-to-all, top-k weighted sum).
- ours: the plan (`MoECombine.plan`, the CuTe DSL planner on CUDA), `prepare` and the plan
  rows' gather index (`plan_gather_index`) run on a side stream while the dispatch all-to-all
  moves the tokens (they need only the counts); the received rows are then placed in the plan
  layout with one gather (`dispatch_to_plan`'s placement) and the up-projection feeds
  `MoECombine` (backend `--backend`, "overlap" on Hopper GPUs). `--up`: that up-projection is the
  library's (torch._grouped_mm + SwiGLU on the plan rows) or, the default on the overlap
  backend, the fused SwiGLU GroupedGemm `MoELayer` launches (on every SM, no arrival wait).
- base: the dispatch into the compact layout, library grouped GEMMs and
  `SameScaleBaseline` (library GEMM, one NCCL all_to_all_single, our scale kernel; on the CPU
  `SequentialBaseline`), in one stream.
Per routing both prepare the same host facts once, outside the timed calls: the all-to-all
split sizes and the padded row count of the plan (a layer knows them from its dispatch); the
baseline also its permutations. Everything the routing decides on the device (counts, plan,
routes, row placement) is recomputed in every timed call.

Timing: on CUDA each layer is captured in one CUDA graph and replayed (interleaved, the slowest
rank counts); the timeline comes from CUDA events between the parts of an eager call queued
behind a GPU sleep (so the events time the GPU, not the Python launch path). On the CPU
everything is eager and timed with perf_counter. After every timed call (outside its timing)
the two layers' outputs are compared (max |ours - base| / max |base|, rows' rel_errs), and after
the last one both against an fp32 reference on each rank's first REF_TOKENS tokens
(`fp32_reference`: the same routing and weights, fp32 products, one rounding). The run agrees
where ours is within --tol of the fp32 reference and, with `--up library` (both layers then
share the up-projection's rounding), within --tol of the base on every call; else it writes its
JSON and exits with status 1. JSON `moe_layer_<tag>.json` and a PNG timeline (matplotlib) in
--out.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass

for _k, _v in (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
               ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("CUDA_MODULE_LOADING", "EAGER")):
    os.environ[_k] = _v  # never NVLink multicast on shared machines; eager module loading
# every shape's layer keeps its receive buffer (2 x T x k x N bf16): 9.4 GB for the 8 model shapes
os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "16G")

import torch  # noqa: E402
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_results import result_header, write_result  # noqa: E402
from moe_overlap.combine import MoECombine, dispatch_to_plan, exchange_counts  # noqa: E402
from moe_overlap.combine.dispatch import plan_gather_index  # noqa: E402
from moe_overlap.combine.baseline import SameScaleBaseline, SequentialBaseline  # noqa: E402
from moe_overlap.combine.options import CombineOptions  # noqa: E402
from moe_overlap.combine.reference import (all_gather_counts, grouped_matmul,  # noqa: E402
                                           source_to_expert_major)
from moe_overlap.combine.shapes import check_world, parse_shapes, shape  # noqa: E402
from moe_overlap.launch import ranks_per_gpu  # noqa: E402
from moe_overlap.runtime import collectives  # noqa: E402
from moe_overlap.timing import sleep_cycles_per_ms  # noqa: E402

# in the order they are queued (on the CPU, the order they run)
PARTS_OURS = ("router", "counts", "plan", "prepare", "place_index", "dispatch_a2a", "place", "up",
              "combine")
PARTS_BASE = ("router", "counts", "dispatch_a2a", "permute", "up", "combine")
SIDE = ("plan", "prepare", "place_index")  # ours: on the side stream
UPS = ("auto", "library", "swiglu")
REF_TOKENS = 32  # tokens per rank checked against the fp32 reference (the last timed call's)
LEAD_MS = 20.0  # GPU sleep ahead of the timeline's eager call (its host enqueue time is less)


@dataclass(frozen=True)
class Options:
    """The run's options, resolved once from the command line."""
    device: str  # "cuda" | "cpu"
    backend: str  # MoECombine backend
    shapes: tuple
    calls: int  # timed calls per layer
    tol: float
    tag: str
    out: str
    wrong: bool  # permute ours' output rows (shows that the agreement check catches it)
    seed: int
    order: str = "remote_first"  # the plans' schedule (CombineOptions.order)
    scale: str = "plain"  # ours' owner scale (MoECombine(scale=)): "plain" or "ordered"
    profile: int = 0  # CUDA only: the N longest kernels of one eager call of each layer
    up: str = "library"  # ours' up-projection (resolved: "library" or "swiglu")

    @property
    def dtype(self):
        return torch.bfloat16 if self.device == "cuda" else torch.float32


def parse_options(argv=None) -> tuple[Options, int]:
    """(Options, --spawn world size: 0 = launched by torchrun or alone)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", choices=("auto", "overlap", "reference"))
    ap.add_argument("--shapes", default="models",
                    help="shapes.parse_shapes items (TxExkxNxK, model[@T], models); T is "
                         "replaced by --tokens where given")
    ap.add_argument("--tokens", default="", help="comma-separated tokens per rank (model shapes)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per layer")
    ap.add_argument("--tol", type=float, default=8e-3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--wrong", action="store_true",
                    help="deliberately wrong ours (output rows rolled by one): must fail")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", default="remote_first", choices=("remote_first", "expert"),
                    help="the combine plans' schedule (CombineOptions.order)")
    ap.add_argument("--scale", default="plain", choices=("plain", "ordered"),
                    help="ours' owner scale (MoECombine(scale=)); ordered: prepare also builds "
                         "the ordered scale's tables, on the side stream with the plan")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="CUDA: also list the N kernels of longest total device time in one "
                         "eager call of each layer (torch.profiler; rows' profile_*)")
    ap.add_argument("--up", default="auto", choices=UPS,
                    help="ours' up-projection on the plan rows: library = torch._grouped_mm + "
                         "SwiGLU (the base's calls); swiglu = MoELayer's fused SwiGLU GroupedGemm "
                         "(CuTe DSL, every SM, no arrival wait); auto = swiglu on CUDA with the "
                         "overlap backend, else library")
    ap.add_argument("--spawn", type=int, default=0,
                    help="run on this many local processes (moe_overlap.launch.spawn) "
                         "instead of under torchrun")
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error("--calls must be >= 1")
    shapes = parse_shapes(a.shapes)
    if a.tokens:
        toks = [int(t) for t in a.tokens.split(",")]
        seen, shapes_t = set(), []
        for s in shapes:
            base = s.get("name", "").partition("@")[0]
            for T in toks:
                key = (base, s["experts"], s["N"], s["K"], T)
                if key not in seen:
                    seen.add(key)
                    shapes_t.append(shape(T, s["experts"], s["topk"], s["N"], s["K"],
                                          name=f"{base}@{T}" if base else ""))
        shapes = shapes_t
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available (use --device cpu --backend reference)")
    if a.device == "cpu" and a.backend == "overlap":
        ap.error("--backend overlap needs --device cuda")
    world = a.spawn or int(os.environ.get("WORLD_SIZE", 1))
    tag = a.tag or (f"{world}x" + ("cpu" if a.device == "cpu" else
                                   torch.cuda.get_device_name().split()[-1].lower()))
    if a.scale == "ordered" and a.device == "cpu":
        ap.error("--scale ordered needs --device cuda (the overlap backend's scale)")
    if a.scale == "ordered" and not a.tag:
        tag += "_ordered"
    if a.up == "swiglu" and (a.device != "cuda" or a.backend != "overlap"):
        ap.error("--up swiglu needs --device cuda --backend overlap (the CuTe DSL GEMM)")
    up = a.up if a.up != "auto" else \
        "swiglu" if a.device == "cuda" and a.backend == "overlap" else "library"
    return Options(a.device, a.backend, tuple(shapes), a.calls, a.tol, tag, a.out, a.wrong,
                   a.seed, a.order, a.scale, a.profile, up), a.spawn


# ------------------------------------------------------------------------------ the device
class Device:
    """Streams, clocks and barriers of one rank: CUDA, or the CPU where all of it is serial."""

    def __init__(self, kind: str):
        self.cuda = kind == "cuda"
        self.dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else \
            torch.device("cpu")
        self.side = torch.cuda.Stream() if self.cuda else None

    def on_side(self):
        """Context running work on the side stream (after what the main stream queued)."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.side.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.side)

    def join_side(self):
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.side)

    def mark(self, stream_side: bool = False):
        """A time mark: a CUDA event on the main or side stream, or the host clock."""
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(self.side if stream_side else torch.cuda.current_stream())
        return e

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self):
        self.sync()
        dist.barrier()


# ------------------------------------------------------------------------------ one layer's data
def make_inputs(s: dict, rank: int, W: int, dtype, dev, seed: int) -> dict:
    """Tokens [T, N], router weight [N, E], this rank's experts' w_up [El, N, 2K] and w_down
    [El, K, N], scaled so every stage's values stay O(1). Experts' weights depend on the global
    expert id (seeded), so the layer is the same function whatever W is."""
    T, E, N, K = s["tokens"], s["experts"], s["N"], s["K"]
    El = E // W
    w_up = torch.empty(El, N, 2 * K, dtype=dtype, device=dev)
    w_down = torch.empty(El, K, N, dtype=dtype, device=dev)
    for e in range(El):  # per global expert, generated on the device (GBs on the big shapes)
        w_up[e], w_down[e] = expert_weights(s, rank * El + e, dtype, dev, seed)
    return dict(x=_randn((T, N), rank, 1.0, dtype, dev, seed),
                w_gate=_randn((N, E), 10_007, N ** -0.5, torch.float32, dev, seed),
                w_up=w_up, w_down=w_down)


def _randn(shape, key, scale, dtype, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + key)
    return (torch.randn(shape, generator=g, device=dev) * scale).to(dtype)


def expert_weights(s: dict, e: int, dtype, dev, seed: int):
    """Global expert e's (w_up [N, 2K] gate half first, w_down [K, N]): the same on any rank."""
    N, K = s["N"], s["K"]
    return (_randn((N, 2 * K), 20_011 + 2 * e, N ** -0.5, dtype, dev, seed),
            _randn((K, N), 20_012 + 2 * e, K ** -0.5, dtype, dev, seed))


def fp32_reference(s: dict, x, ids, w, dev, seed: int, dtype):
    """out [t, N] fp32 of the rows x (this rank's first tokens) from the layer's routing (ids,
    softmax weights w) and every chosen expert's weights as both layers hold them (their dtype,
    regenerated by global id), computed in fp32 with one rounding at the end: sum_j w[t, j] *
    (silu(x_t Wg) * (x_t Wu)) @ Wd. Shares only the weights' generator with the layers."""
    K = s["K"]
    out = torch.zeros(x.shape[0], s["N"], dtype=torch.float32, device=dev)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        wu, wd = (m.float() for m in expert_weights(s, int(e), dtype, dev, seed))
        y = xf[t] @ wu
        h = torch.nn.functional.silu(y[:, :K]) * y[:, K:]
        out.index_add_(0, t, (h @ wd) * w[t, j].float()[:, None])
    return out


def router(x, w_gate, k):
    """Top-k experts [T, k] int64 of the fp32 gate logits, softmax weights [T, k] float32.
    fp32, so that the eager and the captured calls route alike (checked on every call)."""
    top, ids = (x.float() @ w_gate).topk(k, dim=1)
    return ids, torch.softmax(top, dim=1)


def count_exchange(ids, E, group, cuda: bool):
    """All-gathered counts [W, E]. CUDA: torch.bincount reads its maximum on the host (not
    capturable), so the same counts come from a scatter-add and the same all-gather as
    `exchange_counts(validate=False)`; elsewhere `exchange_counts` itself."""
    if not cuda:
        return exchange_counts(ids, E, group, validate=False)
    flat = ids.reshape(-1)
    c = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return all_gather_counts(c, group)


def swiglu(y):
    a, b = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


@dataclass
class Routing:
    """Host facts of one routing, prepared once (what a layer knows from its dispatch)."""
    send_splits: list  # rows this rank sends to each rank in the dispatch
    recv_splits: list  # rows it receives from each rank
    recv_rows: int
    rows_e: list  # compact rows per local expert (the baseline's grouped GEMM)
    plan_rows: int  # padded rows of this rank's plan (ours' up-projection)
    to_compact: torch.Tensor  # source-major -> compact permutation (baseline)


def host_routing(counts, rank, El, plan_rows, dev) -> Routing:
    ch = counts.tolist()
    W = len(ch)
    send = [sum(ch[rank][r * El:(r + 1) * El]) for r in range(W)]
    recv = [sum(ch[s][rank * El:(rank + 1) * El]) for s in range(W)]
    rows_e = [sum(ch[s][rank * El + e] for s in range(W)) for e in range(El)]
    perm = torch.tensor(source_to_expert_major(ch, rank, El), dtype=torch.long, device=dev)
    return Routing(send, recv, sum(recv), rows_e, plan_rows, perm)


def dispatch_a2a(x, ids, rt: Routing, group, zero_row=False):
    """The (token, k) rows of x to their experts' owners: received source-major, then local
    expert, then arrival order (as `dispatch_to_plan` exchanges them)."""
    k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    send = x.index_select(0, order // k)
    # zero_row: one zero row after the received ones, the source of the plan's padding rows
    recv = torch.empty(rt.recv_rows + int(zero_row), x.shape[1], dtype=x.dtype, device=x.device)
    if zero_row:
        recv[rt.recv_rows:].zero_()
    collectives.all_to_all_single(recv[:rt.recv_rows], send, rt.recv_splits, rt.send_splits,
                                  group=group)
    return recv


def up_projection(x, w_up, offs=None, rows_e=None):
    """Grouped GEMM + SwiGLU: torch._grouped_mm with device offsets on CUDA, else the per-expert
    reference product."""
    if x.is_cuda:
        y = torch._grouped_mm(x, w_up, offs=offs)
    else:
        y = grouped_matmul(x, w_up, rows_e)
    return swiglu(y)


class SwigluUp:
    """Ours' up-projection with ``--up swiglu``: the fused SwiGLU GroupedGemm that
    ``MoELayer(backend="overlap")`` launches (``moe_layer.up_projection_gemm``, the layer's
    options), here without the arrival wait (the rows are placed before it) and on every SM
    (ccta 0: no dispatch kernel beside it), walking the plan's schedule. Its weights are the
    bench's w_up [El, N, 2K] (gate half first) in the kernel's interleaved layout, made once
    (a layer's parameter is stored so). Output h [plan rows, K] bf16, the combine's input."""

    def __init__(self, s, data, combine: MoECombine, rt: Routing, dev: Device):
        from moe_overlap.combine.grouped_gemm import interleave_gate_up
        from moe_overlap.moe_layer import MoELayerOptions, up_projection_gemm
        opts = MoELayerOptions()
        self.gemm = up_projection_gemm(opts, combine.tile_m, wait_arrival=False)
        self.w = interleave_gate_up(data["w_up"], opts.up_tile_n)
        self.h = torch.empty(rt.plan_rows, s["K"], dtype=data["w_up"].dtype, device=dev.dev)
        self.epoch = torch.ones(1, dtype=torch.int32, device=dev.dev)
        self.err = torch.zeros(8, dtype=torch.int64, device=dev.dev)
        self.ready = None

    def __call__(self, x_plan, plan):
        if self.ready is None or self.ready.numel() != plan.band_capacity:
            self.ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=x_plan.device)
        self.gemm(x_plan, self.w, self.h, plan.band_expert, plan.band_src_row, plan.schedule,
                  plan.num_bands, self.ready, self.epoch, ccta=0, err=self.err, rank=0)
        return self.h

    def check_errors(self):
        from moe_overlap.kernels.errors import describe_error
        msg = describe_error(self.err.tolist())
        if msg:
            raise RuntimeError(f"the SwiGLU up-projection's error word: {msg}")


# ------------------------------------------------------------------------------ the two layers
class OursLayer:
    """Our layer: plan and prepare on the side stream under the dispatch all-to-all."""

    def __init__(self, s, data, combine: MoECombine, dev: Device, rt: Routing, wrong: bool,
                 up: str = "library"):
        self.s, self.d, self.c, self.dev, self.rt, self.wrong = s, data, combine, dev, rt, wrong
        self.x_plan = torch.zeros(rt.plan_rows, s["N"], dtype=data["x"].dtype, device=dev.dev)
        self.up = SwigluUp(s, data, combine, rt, dev) if up == "swiglu" else None
        self.marks = {}

    def __call__(self, timeline: bool = False):
        s, d, c, dv = self.s, self.d, self.c, self.dev
        m = self.marks if timeline else None
        mark = (lambda name, side=False: m.__setitem__(name, dv.mark(side))) if m is not None \
            else (lambda name, side=False: None)
        mark("start")
        ids, w = router(d["x"], d["w_gate"], s["topk"])
        mark("router")
        counts = count_exchange(ids, s["experts"], c.group, dv.cuda)
        mark("counts")
        with dv.on_side():
            mark("side_start", True)
            plan = c.plan(counts, validate=False)
            mark("plan", True)
            routes = c.prepare(plan, ids)
            mark("prepare", True)
            # the received row of every plan row: it needs only the counts and the plan
            src = plan_gather_index(plan, counts, c.rank, self.rt.recv_rows, self.rt.plan_rows)
            mark("place_index", True)
        recv = dispatch_a2a(d["x"], ids, self.rt, c.group, zero_row=True)
        mark("dispatch_a2a")
        dv.join_side()
        x_plan = torch.index_select(recv, 0, src, out=self.x_plan)
        mark("place")
        if self.up is not None:
            h = self.up(x_plan, plan)
        else:
            offs = torch.cumsum(plan.expert_rows, 0, dtype=torch.int32) if dv.cuda else None
            rows_e = None if dv.cuda else plan.expert_rows.tolist()
            h = up_projection(x_plan, d["w_up"], offs, rows_e)
        mark("up")
        out = c(h, d["w_down"], plan, ids, w, routes=routes)
        if self.wrong:
            out = out.roll(1, 0)
        mark("combine")
        self.last_plan, self.last_counts, self.last_ids = plan, counts, ids
        return out, ids


class BaseLayer:
    """The same-scale sequential layer: compact layout, library GEMMs, one stream."""

    def __init__(self, s, data, group, dev: Device, rt: Routing, counts, ids):
        self.s, self.d, self.group, self.dev, self.rt = s, data, group, dev, rt
        self.combine = SameScaleBaseline(counts, ids, group) if dev.cuda else \
            SequentialBaseline(counts, ids, group, gemm="loop", scale="fp32")
        self.offs = self.combine.offs
        self.marks = {}

    def __call__(self, timeline: bool = False):
        s, d, dv, rt = self.s, self.d, self.dev, self.rt
        m = self.marks if timeline else None
        mark = (lambda name: m.__setitem__(name, dv.mark())) if m is not None \
            else (lambda name: None)
        mark("start")
        ids, w = router(d["x"], d["w_gate"], s["topk"])
        mark("router")
        count_exchange(ids, s["experts"], self.group, dv.cuda)  # a layer's splits need them
        mark("counts")
        recv = dispatch_a2a(d["x"], ids, rt, self.group)
        mark("dispatch_a2a")
        x_c = recv.index_select(0, rt.to_compact)
        mark("permute")
        h = up_projection(x_c, d["w_up"], self.offs, rt.rows_e)
        mark("up")
        out = self.combine(h, d["w_down"], w)
        mark("combine")
        return out, ids


def timeline_of(layer, parts, dev: Device) -> dict:
    """{part: {start_ms, end_ms, ms, stream}} of one eager call of this rank, relative to its
    start. Each part starts where the previous one on its stream ended (ours' side stream: at
    its fork from the main stream); on the CPU there is one stream."""
    dev.barrier()
    if dev.cuda:  # the host queues the whole call while the GPU sleeps
        torch.cuda._sleep(int(LEAD_MS * sleep_cycles_per_ms()))
    layer(timeline=True)
    dev.sync()
    m = layer.marks
    out, prev = {}, {"main": "start", "side": "side_start"}
    for p in parts:
        st = "side" if (dev.cuda and p in SIDE and isinstance(layer, OursLayer)) else "main"
        a, b = m[prev[st]], m[p]
        out[p] = dict(start_ms=dev.ms(m["start"], a), end_ms=dev.ms(m["start"], b),
                      ms=dev.ms(a, b), stream=st)
        prev[st] = p
    return out


def rel_err(a, b) -> float:
    ref = b.float().abs().max().item()
    return (a.float() - b.float()).abs().max().item() / (ref if ref > 0 else 1.0)


def max_over_ranks(x: float, dev: Device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev.dev)
    collectives.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def capture(fn, dev: Device, graph: bool):
    """graph: a CUDA graph of one call (warmed up eagerly on a side stream), replayed by the
    returned function, which returns the call's static outputs. Else the eager call."""
    if not graph:
        return fn
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()

    def replay():
        g.replay()
        return out
    replay.graph = g
    return replay


def timed_call(fn, dev: Device):
    """(output, ms) of one call, the ranks lined up first."""
    dev.barrier()
    a = dev.mark()
    out = fn()
    b = dev.mark()
    dev.sync()
    return out, dev.ms(a, b)


# ------------------------------------------------------------------------------ one shape
def check_placement(ours: OursLayer, rt: Routing, group):
    """The bench's split dispatch (all-to-all, then placement) against `dispatch_to_plan`."""
    ref = dispatch_to_plan(ours.d["x"], ours.last_ids, ours.last_plan, ours.last_counts,
                           group, rows=rt.plan_rows)
    got = ours.x_plan[:rt.plan_rows]
    if not torch.equal(got, ref):
        raise RuntimeError("the bench's dispatch placement differs from dispatch_to_plan")


def check_routing(ids, *calls):
    """The split sizes were prepared for the setup's routing: every call must route alike."""
    for got in calls:
        if not torch.equal(got, ids):
            raise RuntimeError("a timed call routed differently from the setup call (the gate "
                               "GEMM is not deterministic here?): its split sizes are stale")


def check_devices(*layers):
    """Raise if a device wait of an overlapped call or of the scale kernel timed out."""
    for layer in layers:
        if hasattr(layer, "check_errors"):
            layer.check_errors()


def run_shape(s, opts: Options, rank, W, dev: Device) -> dict:
    """Build both layers for shape s, check them, time them; one JSON row."""
    group = None
    data = make_inputs(s, rank, W, opts.dtype, dev.dev, opts.seed)
    combine = MoECombine(s["experts"], s["K"], s["N"], s["topk"], s["tokens"], group=group,
                         backend=opts.backend, validate=False, scale=opts.scale,
                         options=CombineOptions(order=opts.order))
    ids, _ = router(data["x"], data["w_gate"], s["topk"])
    counts = count_exchange(ids, s["experts"], group, dev.cuda)
    plan0 = combine.plan(counts, validate=False)
    combine.prepare(plan0, ids)  # starts the overlap backend here, on the main stream
    plan_rows = int(plan0.total_rows.item())
    rt = host_routing(counts, rank, s["experts"] // W, plan_rows, dev.dev)
    ours = OursLayer(s, data, combine, dev, rt, opts.wrong, opts.up)
    base = BaseLayer(s, data, group, dev, rt, counts, ids)
    backend = combine.backend_for(dev.dev)
    # the reference backend reads plan values on the host: not capturable, timed eagerly; so
    # are gloo's collectives (ranks sharing one GPU: NCCL refuses), staged through the host
    graph = dev.cuda and backend == "overlap" and dist.get_backend(group) != "gloo"
    with torch.inference_mode():
        ours()  # first calls: compile and load kernels, pick the baseline's GEMM variant
        base()
        check_placement(ours, rt, group)
        # the timeline's eager calls before the capture: eager warm-up, capture, replays
        tl_o, tl_b = timeline_of(ours, PARTS_OURS, dev), timeline_of(base, PARTS_BASE, dev)
        prof = {f"profile_{n}": kernel_profile(layer, opts.profile)
                for n, layer in (("ours", ours), ("base", base))} \
            if dev.cuda and opts.profile else {}
        run_o, run_b = capture(ours, dev, graph), capture(base, dev, graph)
        t_o, t_b, errs = [], [], []
        for _ in range(opts.calls):
            (out_o, ids_o), ms_o = timed_call(run_o, dev)
            (out_b, ids_b), ms_b = timed_call(run_b, dev)
            t_o.append(ms_o)
            t_b.append(ms_b)
            check_routing(ids, ids_o, ids_b)  # outside the timing, as the agreement
            errs.append(max_over_ranks(rel_err(out_o, out_b), dev))
        # both layers against an fp32 reference on this rank's first tokens (the last call's
        # routing): the agreement check, since ours' up-projection (--up swiglu) rounds once
        # where the base's rounds twice, so the two differ by more than either from the truth
        n = min(REF_TOKENS, data["x"].shape[0])
        ref = fp32_reference(s, data["x"][:n], ids_o[:n], router(data["x"], data["w_gate"],
                                                                   s["topk"])[1][:n],
                             dev.dev, opts.seed, opts.dtype)
        ref_err_o = max_over_ranks(rel_err(out_o[:n], ref) if n else 0.0, dev)
        ref_err_b = max_over_ranks(rel_err(out_b[:n], ref) if n else 0.0, dev)
        check_devices(combine, base.combine, *([ours.up] if ours.up else []))
    ours_ms = max_over_ranks(statistics.median(t_o), dev)
    base_ms = max_over_ranks(statistics.median(t_b), dev)
    side_end = max(tl_o[p]["end_ms"] for p in SIDE)
    exposed = max(0.0, side_end - tl_o["dispatch_a2a"]["end_ms"])
    nb = int(ours.last_plan.num_bands)
    schedule_sorted = ours.last_plan.schedule[:nb].tolist() == list(range(nb))
    return dict(shape=s, name=s.get("name", ""), backend=backend,
                timing="cuda graph replays" if graph else "eager",
                ours_ms=ours_ms, base_ms=base_ms, speedup=base_ms / ours_ms,
                ours_times_ms=t_o, base_times_ms=t_b, timeline_ours=tl_o, timeline_base=tl_b,
                plan_prepare_ms=sum(tl_o[p]["ms"] for p in ("plan", "prepare")),
                side_ms=sum(tl_o[p]["ms"] for p in SIDE),
                plan_exposed_ms=exposed if dev.cuda else None,
                plan_hidden=(exposed <= 0.0) if dev.cuda else None,
                plan_rows=plan_rows, recv_rows=rt.recv_rows,
                plan_order=ours.last_plan.order, plan_schedule_sorted=schedule_sorted,
                rel_errs=errs, max_rel_err=max(errs), ref_tokens=REF_TOKENS,
                ours_err_vs_fp32=ref_err_o, base_err_vs_fp32=ref_err_b,
                agree=ref_err_o <= opts.tol and (opts.up == "swiglu" or max(errs) <= opts.tol),
                **prof)


def kernel_profile(layer, n: int) -> list:
    """The n kernels (by name) of longest total device time in one eager call of ``layer``
    (torch.profiler): [{"kernel", "calls", "us"}], longest first. A diagnosis of where a
    part's time goes, not a timing (the profiler serializes nothing, but adds its own
    overhead between launches)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = tot.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(tot.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"kernel": k, "calls": c, "us": round(us, 1)} for k, (c, us) in rows]


# ------------------------------------------------------------------------------ the run
def label_of(row) -> str:
    s = row["shape"]
    return row["name"] or "x".join(str(s[k]) for k in ("tokens", "experts", "topk", "N", "K"))


def plot(doc: dict, path: str) -> str:
    """One panel per shape: each part as a bar on its stream's lane, ours above base."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    rows = doc["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.8 * len(rows) + 0.5), squeeze=False)
    colors = plt.get_cmap("tab10")
    names = sorted({p for r in rows for p in list(r["timeline_ours"]) + list(r["timeline_base"])})
    for ax, r in zip(axes[:, 0], rows):
        lanes = [("base", r["timeline_base"], "main"), ("ours side", r["timeline_ours"], "side"),
                 ("ours", r["timeline_ours"], "main")]
        for y, (label, tl, st) in enumerate(lanes):
            for p, v in tl.items():
                if v["stream"] == st:
                    ax.barh(y, v["ms"], left=v["start_ms"], color=colors(names.index(p) % 10),
                            edgecolor="k", linewidth=0.3)
                    ax.text(v["start_ms"] + v["ms"] / 2, y, p, ha="center", va="center",
                            fontsize=6)
        ax.set_yticks(range(len(lanes)), [lab for lab, _, _ in lanes], fontsize=7)
        ax.set_title(f"{label_of(r)}: ours {r['ours_ms']:.3f} ms, base "
                     f"{r['base_ms']:.3f} ms ({r['speedup']:.2f}x), plan hidden: "
                     f"{r['plan_hidden']}", fontsize=8)
    clock = "perf_counter" if doc["device"] == "cpu" else "CUDA events"
    axes[-1, 0].set_xlabel(f"ms from the layer's start (rank 0's eager call, {clock})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def run_rank(rank: int, W: int, opts: Options) -> dict:
    """Every shape on this rank (process group already initialized); rank 0 writes the JSON."""
    dev = Device(opts.device)
    check_world(list(opts.shapes), W)
    if dev.cuda and opts.backend != "reference":
        # the layers share one communication buffer; a captured call pins its addresses, so
        # it is sized for the largest shape before the first shape's capture
        from moe_overlap.combine.comm_buffer import CommBuffer
        buf = CommBuffer.shared(None, CombineOptions().transport, torch.bfloat16)
        for s in opts.shapes:
            buf.reserve(s["tokens"] * s["topk"], s["N"] * 2)
    rows = []
    for s in opts.shapes:
        r = run_shape(s, opts, rank, W, dev)
        rows.append(r)
        if dev.cuda:
            torch.cuda.empty_cache()  # the shape's graphs and tensors are gone
        if rank == 0:
            print(f"{label_of(r)}: ours {r['ours_ms']:.3f} ms  base {r['base_ms']:.3f} ms  "
                  f"speedup {r['speedup']:.3f}x  plan+prepare {r['plan_prepare_ms']:.3f} ms "
                  f"hidden {r['plan_hidden']}  max rel err {r['max_rel_err']:.2e}  vs fp32: "
                  f"ours {r['ours_err_vs_fp32']:.2e} base {r['base_err_vs_fp32']:.2e}"
                  + ("  [ranks share one GPU: times are not speedups]" if ranks_per_gpu() > 1
                     else ""), flush=True)
            for n in ("ours", "base"):
                for k in r.get(f"profile_{n}", []):
                    print(f"    {n:<4} {k['us']:10.1f} us {k['calls']:4d}x  {k['kernel']}")
    # ranks sharing one GPU (launch backend "cuda" with fewer GPUs than ranks): the run checks
    # correctness; its times are of ranks competing for one GPU, never a speedup
    shared = ranks_per_gpu() > 1
    doc = dict(result_header("moe_layer", cuda=dev.cuda), world_size=W, tol=opts.tol,
               ranks_per_gpu=ranks_per_gpu(), timings_are_speedups=not shared,
               wrong=opts.wrong, calls=opts.calls, order=opts.order, scale=opts.scale,
               up=opts.up,
               method=("one layer call per timed call (a CUDA graph replay with the overlap "
                       "backend, else eager: rows' timing), ours and base interleaved, median, "
                       "the slowest rank (the per-call lists: rank 0's); timeline: rank 0's eager "
                       "call, CUDA events behind a "
                       "GPU sleep" if dev.cuda else
                       "eager calls, perf_counter, ours and base interleaved, median, the "
                       "slowest rank; timeline: rank 0's eager call"),
               agree=all(r["agree"] for r in rows), rows=rows)
    if rank == 0:
        print(f"wrote {write_result(doc, opts.out, f'moe_layer_{opts.tag}.json')}")
        print(plot(doc, os.path.join(opts.out, f"moe_layer_{opts.tag}.png")))
    return dict(agree=doc["agree"], max_rel_err=max(r["max_rel_err"] for r in rows),
                max_fp32_err=max(r["ours_err_vs_fp32"] for r in rows))


def _spawned(rank, W, opts):
    return run_rank(rank, W, opts)  # spawn placed the rank on its device


def main(argv=None) -> int:
    opts, spawn_w = parse_options(argv)
    if spawn_w:
        from moe_overlap.launch import spawn
        res = spawn(_spawned, spawn_w, opts, backend="cuda" if opts.device == "cuda" else "gloo",
                    join_timeout_s=1800)
    else:
        rank = int(os.environ.get("RANK", 0))
        if opts.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "WORLD_SIZE" not in os.environ:  # alone: a one-rank group
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
                "MASTER_PORT", "29517"), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl" if opts.device == "cuda" else "gloo")
        try:
            res = [run_rank(rank, dist.get_world_size(), opts)]
        finally:
            dist.destroy_process_group()
    if not all(r["agree"] for r in res):
        print(f"FAIL: the two layers' outputs disagree (max rel err "
              f"{max(r['max_rel_err'] for r in res):.3e}, ours against the fp32 reference "
              f"{max(r['max_fp32_err'] for r in res):.3e}; tolerance {opts.tol})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
