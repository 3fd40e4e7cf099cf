"""MoEDispatch(backend="overlap")'s real host path, ``_forward_overlap`` with a real CommBuffer
(its attach, slot sizes, peer tables) and the real ``DispatchSend.launch`` /
``DispatchExpand.launch``, run on the host: the kernels' compiled PTX goes to
tests/ptx_emulator.py with the exact ints the wrappers pass (tensor addresses mapped into one
emulated memory), every global load and store checked against the allocations (address 0, a gap
or a row past a tensor raises as an illegal address would on the GPU). The first GPU run
(session 22, H100, 2 ranks under MPS) ended the first call of tests/test_dispatch_overlap_gpu.py
in an illegal address; tests/test_dispatch_overlap_emulated.py builds its own argument lists, so
this file runs that exact case through the wrappers: D = 256, K = 4, T_MAX = 96, W = 2 and 4,
tile_m 64, aligned, rank 1 no tokens (its x / ids at address 0), the others 70, rows =
plan.row_capacity, the plan's tensors laid out as the kernel planner's (views of one int32
buffer, combine/plan_kernel.py _Layout), 8 send CTAs of 256 threads, the expand grid from the
MPS share of SMs (132 // W).

The ranks run in one process: a fake symmetric runtime (CPU tensors, peer tables filled once
every rank has allocated) stands in for NVSHMEM; the launches are queued per rank and run as the
GPU would order them across ranks (every send, then every owner's wait + expand). Which
launcher int reaches which kernel parameter, each launch's grid and block and its dynamic shared
memory are read from the launchers' host code as CuTe DSL generates it (its IR), not restated
here; a shared access past the launch's bytes raises too. The GPU test's next two token counts
follow (1 + 29 * rank, then T_MAX: slot parity 0, cumulative counters); the per-source expand
(signal_arrival, 4 CTAs) runs the same calls at W = 2; W = 4 runs the first call only."""
import os
import re
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx  # noqa: E402
from emulated_launch import Device, host_launches  # noqa: E402

pytestmark = pytest.mark.compile

W = 2  # the world size of the running case (the test sets it)
EL, D, K, T_MAX, TILE_M = 4, 256, 4, 96, 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


class World:
    """Every emulated rank's symmetric allocations (index i of each rank is one allocation)."""

    def __init__(self):
        self.allocs = [[] for _ in range(W)]
        self.tables = []  # (rank, allocation index, int64 [W] table)

    def fill_tables(self):
        for r, i, table in self.tables:
            table.copy_(torch.tensor([self.allocs[pe][i].data_ptr() for pe in range(W)]))


class FakeRuntime:
    """The NvshmemRuntime surface CommBuffer uses, on CPU tensors."""

    def __init__(self, world, rank):
        self.world, self.rank, self.world_size = world, rank, W
        self.device = torch.device("cpu")

    def alloc(self, shape, dtype, note=""):
        t = torch.zeros(shape, dtype=dtype)
        self.world.allocs[self.rank].append(t)
        return t

    def free(self, t):
        raise AssertionError("no growth expected here")

    def peer_table(self, t):
        i = next(i for i, a in enumerate(self.world.allocs[self.rank]) if a is t)
        table = torch.zeros(W, dtype=torch.int64)
        self.world.tables.append((self.rank, i, table))
        return table, ()

    def barrier(self, what=""):
        pass


_PTX = {}


def _ptx(kind, obj):
    from moe_overlap.combine.dispatch_expand import build_dispatch_expand, expand_example_args
    from moe_overlap.combine.dispatch_send import build_dispatch_send, send_example_args
    key = (kind, obj.world_size, obj.topk, obj.threads, getattr(obj, "signal_arrival", None),
           getattr(obj, "wait", None))
    if key not in _PTX:
        if kind == "send":
            _PTX[key] = compile_ptx(build_dispatch_send(obj.world_size, obj.topk, obj.threads),
                                    *send_example_args())
        else:
            _PTX[key] = compile_ptx(build_dispatch_expand(obj.world_size, obj.topk, obj.threads,
                                                          obj.signal_arrival, obj.wait),
                                    *expand_example_args(obj.signal_arrival, obj.wait))
    return _PTX[key]


_HOST = {}


def _host_launches(kind, obj):
    """The @cute.jit launcher's host code as CuTe DSL generates it (CUTE_DSL_PRINT_IR, in a
    fresh process: the IR is printed by MLIR to the process's stdout): its launches in order,
    each (kernel entry name, operands, (grid x, grid y), block x, dynamic shared bytes), an operand /
    size being ("arg", i) for the launcher's i-th int or ("const", value). So the routing of
    the wrappers' ints to the kernels' parameters is the compiled one, not restated here."""
    import subprocess
    import sys
    import tempfile
    key = (kind, obj.world_size, obj.topk, obj.threads, getattr(obj, "signal_arrival", None),
           getattr(obj, "wait", None))
    if key in _HOST:
        return _HOST[key]
    if kind == "send":
        code = ("from moe_overlap.combine.dispatch_send import build_dispatch_send as b, "
                "send_example_args as a\n"
                f"f, x = b({obj.world_size}, {obj.topk}, {obj.threads}), a()\n")
    else:
        code = ("from moe_overlap.combine.dispatch_expand import build_dispatch_expand as b, "
                "expand_example_args as a\n"
                f"f = b({obj.world_size}, {obj.topk}, {obj.threads}, {obj.signal_arrival}, "
                f"{obj.wait!r})\nx = a({obj.signal_arrival}, {obj.wait!r})\n")
    code += ("import cutlass.cute as cute\nc = cute.compile(f, *x)\n"
             "print('LOWERED_HOST_IR_BEGIN')\nprint(str(c.ir_module))\n")
    env = dict(os.environ, CUTE_DSL_PRINT_IR="1", CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as d:  # whatever the compile dumps stays out of the repo
        ir = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True, timeout=600, cwd=d).stdout
    ir, lowered = ir.split("LOWERED_HOST_IR_BEGIN", 1)
    _HOST[key] = host_launches(ir, lowered)
    return _HOST[key]


class Launches:
    """Stands in for LaunchCache and the compile step: queues (rank, kind, kernel object, the
    launcher's ints translated) and runs each launch of the launcher's compiled host code."""

    def __init__(self, dev):
        self.dev, self.queue, self.rank = dev, [], 0

    def launcher(self, fn):
        kind, obj = fn

        def call(ints, stream_handle):
            self.queue.append((self.rank, kind, obj, [self.dev.translate(int(v)) for v in ints]))
        return call

    def run(self):
        order = sorted(self.queue, key=lambda q: (q[1] != "send", q[0]))
        self.queue = []
        for rank, kind, obj, a in order:
            ptx = _ptx(kind, obj)

            def val(o):
                return a[o[1]] if o[0] == "arg" else o[1]
            for name, ops, grid, block, smem in _host_launches(kind, obj):
                entry = re.search(rf"\.entry\s+{name}\(([^)]*)\)", ptx)
                assert entry and entry.group(1).count(".param") == len(ops), name
                assert val(grid[1]) == 1, (name, grid)  # the dispatch's grids are 1-D
                self.dev.run(ptx, name, val(grid[0]), val(block), [val(o) for o in ops], smem)


def _kernel_layout(plan):
    """The plan with its tensors as views of one int32 buffer, as the kernel planner lays it
    out (combine/plan_kernel.py _Layout; the scalars at offsets 0..7)."""
    import dataclasses
    from moe_overlap.combine.plan_kernel import SCALARS, _Layout
    B = plan.band_capacity
    S = B + plan.num_experts
    lay = _Layout(W, plan.num_experts, EL, B, S)
    buf = torch.full((lay.total,), -0x5A5A5A5B, dtype=torch.int32)
    v = lay.views(buf, W, plan.num_experts, EL, B, S)
    repl = {}
    for name, view in v.items():
        src = getattr(plan, name, None)
        if isinstance(src, torch.Tensor) and src.numel() == view.numel():
            view.copy_(src.reshape(view.shape))
            repl[name] = view
    assert {"expert_row_start", "group_row_start", "expert_rows", "total_rows",
            "counts_fingerprint"} <= set(repl), sorted(repl)
    assert set(SCALARS) <= set(v)
    return dataclasses.replace(plan, **repl)


def _expected(xs, ids, plan, counts, rank, rows):
    """Owner ``rank``'s plan-layout rows, straight from the definition: (token, k) order inside
    each (expert, source) group at expert_row_start[e] + group_row_start[e, s]; zero elsewhere."""
    out = torch.zeros(rows, D, dtype=torch.bfloat16)
    for e in range(EL):
        g = rank * EL + e
        for s in range(W):
            a = int(plan.expert_row_start[e]) + int(plan.group_row_start[e, s])
            hits = [(t, j) for t in range(ids[s].shape[0]) for j in range(K)
                    if int(ids[s][t, j]) == g]
            assert len(hits) == int(counts[s, g])
            for p, (t, _) in enumerate(hits):
                out[a + p] = xs[s][t]
    return out


def _inputs(tokens, seed):
    E = EL * W
    xs, ids = [], []
    for r, T in enumerate(tokens):
        g = torch.Generator().manual_seed(seed * 100 + r)
        i = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros(0, K, dtype=torch.long)
        ids.append(i)
        xs.append(torch.randn(T, D, generator=g).to(torch.bfloat16))
    return xs, ids


PER_SOURCE = dict(signal_arrival=True, expand_wait="per_source", expand_ctas=4)
# the nvshmem transport's staged source (MoEDispatch(stage_source="always")): its puts cannot run
# here (no NVSHMEM device library in the emulator), so the send's launches run the nvlink
# kernel's PTX (``_ptx`` builds the default transport): both kernels read their source at the
# same addresses (row x + t * row_bytes, ids + t * K * 4) and deliver to the same slot words,
# so the staged call's launch ints through it show whether the staged copies are the tokens,
# in the layout the kernel reads, at the addresses the send gets
STAGED = dict(transport="nvshmem", stage_source="always")


@pytest.mark.parametrize("w,opts", [(2, {}), (2, PER_SOURCE), (4, {}), (2, STAGED)],
                         ids=["w2-all", "w2-per_source", "w4-all", "w2-nvshmem-staged"])
def test_forward_overlap_through_the_real_launchers(monkeypatch, w, opts):
    """The GPU test's cases through _forward_overlap and the launch wrappers (its first: rank 1
    with no tokens, the others 70; then 1 + 29 * rank and T_MAX each): bitwise the plan layout on
    every owner, no load or store outside an allocation, error words 0. Staged (nvshmem,
    stage_source="always"): the send's x and ids are the CommBuffer's staging region (x rows at
    its start, ids at stage_x_bytes), which holds the call's tokens and int32 ids when the send
    runs, and the owners' rows are bitwise the plan layout (as the unstaged cases')."""
    opts = dict(opts)
    transport = opts.pop("transport", "nvlink")
    import moe_overlap.combine.dispatch_dedup as DD
    import moe_overlap.runtime.device as DV
    from moe_overlap import MoEDispatch
    from moe_overlap.combine.comm_buffer import CommBuffer
    from moe_overlap.combine.dispatch_expand import DispatchExpand
    from moe_overlap.combine.dispatch_send import DispatchSend
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.kernels import primitives as P

    import sys
    monkeypatch.setattr(sys.modules[__name__], "W", w)
    sms = 132 // W  # the MPS share of an H100 each rank reads (session 22: 66 at W = 2)
    world, dev = World(), Device()
    L = Launches(dev)
    cur = {"rank": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # no
    # record_stream on CPU tensors; note_call then marks the buffer captured (no growth here)
    monkeypatch.setattr(DD, "world", lambda group: (cur["rank"], W))
    monkeypatch.setattr(DV, "num_sms", lambda device: sms)
    monkeypatch.setattr(DispatchSend, "compile", lambda self: ("send", self))
    monkeypatch.setattr(DispatchExpand, "compile", lambda self: ("expand", self))
    monkeypatch.setattr(P, "LaunchCache", L.launcher)
    real_ptr = torch.Tensor.data_ptr

    def data_ptr(t):  # every tensor whose address reaches a kernel gets device memory
        dev.register(t)
        return real_ptr(t)

    layers, comms = [], []
    for r in range(W):
        cur["rank"] = r
        comm = CommBuffer(None, transport, runtime=FakeRuntime(world, r))
        layers.append(MoEDispatch(EL * W, D, K, T_MAX, backend="overlap", comm_buffer=comm,
                                  timeout_s=2.0, validate=False, **opts))
        comms.append(comm)
        assert layers[-1].staged == (opts.get("stage_source") == "always")
        assert (comm.stage is not None) == layers[-1].staged
    world.fill_tables()
    for r in range(W):
        for a in world.allocs[r]:
            dev.register(a)
        for t in (comms[r].buffers.recv_peers, comms[r].buffers.ctr_peers, comms[r].err_peers):
            dev.register(t, table=True)
    for comm in comms:
        comm.buffers.recv.fill_(float("nan"))  # poisoned slots, as the GPU test
    E = EL * W
    cases = [[0 if r == 1 else 70 for r in range(W)], [1 + 29 * r for r in range(W)],
             [T_MAX] * W][:1 if W > 2 else None]  # W = 4: the failing first call (time)
    for call, tokens in enumerate(cases):
        xs, ids = _inputs(tokens, seed=call)
        counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
        plans, outs = [], []
        monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
        try:
            for r in range(W):
                cur["rank"] = r
                L.rank = r
                # one band capacity for every call (the arrival flags keep theirs)
                plan = _kernel_layout(plan_combine(counts, r, tile_m=TILE_M, layout="aligned",
                                                   max_rows=W * T_MAX * K))
                plans.append(plan)
                outs.append(layers[r](xs[r], ids[r], plan, counts, rows=plan.row_capacity))
        finally:
            monkeypatch.setattr(torch.Tensor, "data_ptr", real_ptr)
        assert tokens[1] or layers[1].staged or real_ptr(xs[1]) == 0  # 0 tokens: x at 0
        sends = {r: a for r, kind, _, a in L.queue if kind == "send"}
        assert sorted(sends) == list(range(W))
        for r in range(W):
            if not layers[r].staged:
                continue
            st = comms[r].stage
            want = [dev.translate(real_ptr(st)),
                    dev.translate(real_ptr(st) + comms[r].stage_x_bytes)]
            assert sends[r][:2] == (want if tokens[r] else [0, 0])  # empty views: address 0
            sx, sids = comms[r].staged_source(tokens[r], D, K)
            assert torch.equal(sx.view(torch.int16), xs[r].view(torch.int16))
            assert torch.equal(sids, ids[r].to(torch.int32))
        L.run()
        for r in range(W):
            assert [int(v) for v in comms[r].err.tolist()] == [0] * 8, (call, r)
            want = _expected(xs, ids, plans[r], counts, r, plans[r].row_capacity)
            assert torch.equal(outs[r].view(torch.int16), want.view(torch.int16)), (call, r)
            if opts.get("signal_arrival"):
                nb = int(plans[r].num_bands)
                assert (layers[r].band_arrived[:nb] == comms[r].epoch).all(), (call, r)


@pytest.mark.parametrize("opts", [{}, dict(signal_arrival=True),
                                  dict(signal_arrival=True, wait="per_source"),
                                  dict(wait="per_source")],
                         ids=["all", "all-signal", "per_source-signal", "per_source"])
def test_warmup_launches_change_nothing(monkeypatch, opts):
    """MoEDispatch's first-call warm-up runs the send and the wait + expand through their real
    launch wrappers with an error word of their own set: no load or store outside what they
    pass (a store through the zero peer table would hit address 0), and every tensor they pass
    is as it was (no marker, no flag, no count left)."""
    import sys
    from moe_overlap.combine.dispatch_expand import DispatchExpand
    from moe_overlap.combine.dispatch_send import DispatchSend
    from moe_overlap.kernels import primitives as P
    monkeypatch.setattr(sys.modules[__name__], "W", 2)
    dev = Device()
    L = Launches(dev)
    monkeypatch.setattr(DispatchSend, "compile", lambda self: ("send", self))
    monkeypatch.setattr(DispatchExpand, "compile", lambda self: ("expand", self))
    monkeypatch.setattr(P, "LaunchCache", L.launcher)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: L.run())
    real_ptr = torch.Tensor.data_ptr
    passed = []

    def data_ptr(t):
        dev.register(t)
        passed.append((t, t.clone()))
        return real_ptr(t)

    monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
    try:
        DispatchSend(2, K, ctas=3).warmup("cpu")
        DispatchExpand(2, K, **opts).warmup("cpu", EL, 66)
    finally:
        monkeypatch.setattr(torch.Tensor, "data_ptr", real_ptr)
    assert len(passed) >= 4 and not L.queue
    for t, before in passed:
        assert torch.equal(t, before)
