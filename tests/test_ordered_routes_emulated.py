"""The ordered scale's table kernels (combine/ordered_routes_kernel.py: senders, keys, the
counting sort, tiles, compact) and prepare's routes kernels (combine/routes.py: histogram, rank;
launched by the tables' path when it is not given the rows) run on the host: their compiled PTX
goes to tests/ptx_emulator.py through the real wrappers (``ordered_tables_kernel``, i.e.
``OrderedRoutesKernel.__call__``'s start / finish and ``RoutesKernel.__call__``) with the exact
ints they pass, every tensor address mapped into one emulated global memory whose gaps are
poisoned (a load or store outside every allocation raises, as an illegal address would), every
output and workspace poisoned before the call (``_empty`` and routes.py's ``torch.empty``), and
every CTA's shared memory poisoned and exactly the launch's dynamic bytes. Which launcher int
reaches which kernel parameter, each launch's grid (x, y), block and dynamic shared bytes are
read from the launchers' host code as CuTe DSL generates it (its IR), not restated here.

Each table, the dependency arrays' -1 padding included, seg_count, each sender's prefix of
seg_inc (and the poison past it: nothing is written there) and the rows prepare computes are
compared with the torch path (``ordered_routes_device(impl="torch")``, bitwise the host
reference ``ordered_scale.ordered_routes``: tests/test_ordered_routes_cpu.py). The GPU version
is tests/test_ordered_routes_kernel_gpu.py; this one runs small routings on a CPU: W in
{1, 2, 4}, k in {2, 8}, a sender with no tokens and an owner with none, tile CTAs of 32 to 512
threads (NTT < 1024: the warps the block scan must not read past).
"""
import contextlib
import io
import os
import re
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from emulated_launch import Device, host_launches  # noqa: E402
from ptx_emulator import Emulator  # noqa: E402
from moe_overlap.combine import ordered_routes_kernel as ork  # noqa: E402
from moe_overlap.combine import routes as R  # noqa: E402
from moe_overlap.combine.ordered_routes import ordered_routes_device  # noqa: E402
from moe_overlap.combine.plan import plan_combine  # noqa: E402
from moe_overlap.combine.routes import prepare_routes_torch  # noqa: E402
from moe_overlap.routing import route  # noqa: E402

pytestmark = pytest.mark.compile

POISON = {torch.int32: -0x5A5A5A5B, torch.int64: -0x5A5A5A5A5A5A5A5B}


# ---- the compiled launchers: PTX and the host code's launches ----------------------------------
def _compile(real_compile, launcher, args):
    """(PTX, launches) of one ``cute.compile(launcher, *args)``: launches in order, each (kernel
    entry, operands, (grid x, grid y), block x, dynamic shared bytes), an operand / size being
    ("arg", i) for the launcher's i-th argument or ("const", value), from the host IR CuTe DSL
    prints (CUTE_DSL_PRINT_IR's switch, on for this compile only) and the lowered module."""
    import tempfile
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.base_dsl.dsl import BaseDSL
    dsl = BaseDSL._get_dsl()
    was = dsl.envar.print_ir
    out = io.StringIO()
    dsl.envar.print_ir = True
    try:
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(out):
            c = real_compile[(cute.KeepPTX(), DumpDir(d))](launcher, *args)
            ptx = c.__ptx__
    finally:
        dsl.envar.print_ir = was
    ir = out.getvalue()
    assert ptx and "func.func @cutlass_" in ir, "CuTe DSL printed no host IR / kept no PTX"
    return ptx, host_launches(ir, str(c.ir_module))


_DEVICE = []  # the running test's Device


def _fake_compile(real_compile):
    """Stands in for ``cute.compile`` in the wrappers: the compiled PTX and host launches of the
    same launcher and example args, returned as a callable that takes the wrapper's ints (and
    its stream, ignored) and runs each launch on the emulator in order."""

    def compile_(launcher, *args):  # once per variant: the wrappers cache what it returns
        ptx, launches = _compile(real_compile, launcher, args)

        def run(*a):
            dev = _DEVICE[-1]
            ints = [dev.translate(int(v)) for v in a[:-1]]

            def val(o):
                return ints[o[1]] if o[0] == "arg" else o[1]
            for entry, ops, grid, block, smem in launches:
                found = re.search(rf"\.entry\s+{entry}\(([^)]*)\)", ptx)
                assert found and found.group(1).count(".param") == len(ops), entry
                dev.run(ptx, entry, (val(grid[0]), val(grid[1])), val(block),
                        [val(o) for o in ops], smem)
        return run
    return compile_


class _PoisonedTorch:
    """routes.py's ``torch`` with ``empty`` poisoned (its rows, workspace and increments)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, dtype=torch.float32, device=None):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) \
            else shape
        return torch.full(tuple(shape), POISON[dtype], dtype=dtype, device=device)


@pytest.fixture(scope="module", autouse=True)
def _own_caches():
    """The wrappers' compile caches hold this module's emulated launchers: fresh dicts here, the
    real ones back after the module."""
    saved = ork.OrderedRoutesKernel._cache, R.RoutesKernel._cache
    ork.OrderedRoutesKernel._cache, R.RoutesKernel._cache = {}, {}
    yield
    ork.OrderedRoutesKernel._cache, R.RoutesKernel._cache = saved


@contextlib.contextmanager
def emulated_device(monkeypatch):
    """While open, the wrappers' ``cute.compile`` gives emulated launchers, their streams are
    stand-ins, every output and workspace they allocate starts poisoned (``_empty`` and
    routes.py's ``torch.empty``) and every tensor whose address they take gets device memory:
    yields the Device (its ``launches`` in order)."""
    import cutlass.cute as cute
    dev = Device()
    _DEVICE.append(dev)
    stream = SimpleNamespace(cuda_stream=0, wait_stream=lambda other: None)
    monkeypatch.setattr(cute, "compile", _fake_compile(cute.compile))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(ork, "_side_stream", lambda device: stream)
    monkeypatch.setattr(ork, "_empty", lambda n, dtype, device: torch.full(
        (n,), POISON[dtype], dtype=dtype, device=device))
    monkeypatch.setattr(R, "torch", _PoisonedTorch())

    def prepare_routes(topk_ids, E, W, rank, local_copy, plan, impl="auto"):
        # prepare_routes(impl="kernel")'s launch (its CUDA check aside: the tensors are CPU's)
        assert impl == "kernel"
        return R._KERNEL(topk_ids, E, W, rank, local_copy, plan)
    monkeypatch.setattr(R, "prepare_routes", prepare_routes)
    real_ptr = torch.Tensor.data_ptr

    def data_ptr(t):  # every tensor whose address reaches a kernel gets device memory
        dev.register(t)
        return real_ptr(t)
    monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
    try:
        yield dev
    finally:
        monkeypatch.setattr(torch.Tensor, "data_ptr", real_ptr)
        _DEVICE.pop()


def emulated_tables(monkeypatch, ids, counts, plan, tile_tokens, rows=None):
    """``ordered_tables_kernel(ids, counts, plan, tile_tokens, rows)`` (the kernel path of
    ``ordered_routes_device``) with every launch on the emulator: (tables, seg_inc, seg_count,
    rows, launches)."""
    with emulated_device(monkeypatch) as dev:
        tables, seg_inc, seg_count, rows = ork.ordered_tables_kernel(ids, counts, plan,
                                                                     tile_tokens, rows)
    return tables, seg_inc, seg_count, rows, dev.launches


# ---- the routings ------------------------------------------------------------------------------
def _world(W, E, tokens, k, mode, seed):
    """Every rank's ids (tokens[r] x k, int64) and the [W, E] counts."""
    ids = [route(T, E, k, mode, seed=seed, rank=r)[0] if T else torch.zeros(0, k,
                                                                           dtype=torch.long)
           for r, T in enumerate(tokens)]
    return ids, torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])


CASES = [  # (name, W, E, tokens per rank, k, owner, tile_tokens, layout, order, ids dtype, mode)
    ("w1_k2_ntt32", 1, 8, [300], 2, 0, 16, "auto", "remote_first", torch.int64, "balanced"),
    ("w2_k8_ntt128", 2, 16, [257, 190], 8, 1, 16, "aligned", "remote_first", torch.int32,
     "stress_skew"),
    ("w4_k8_ntt512_idle_sender", 4, 32, [120, 0, 200, 90], 8, 2, 64, "packed", "expert",
     torch.int64, "moderate_skew"),
    ("w4_k2_ntt32_tile1", 4, 16, [64, 100, 80, 30], 2, 0, 1, "auto", "remote_first",
     torch.int32, "balanced"),
    ("w2_k2_owner_idle", 2, 8, [150, 0], 2, 1, 16, "auto", "remote_first", torch.int64,
     "balanced"),
    # two sort chunks (SORT_CHUNK tokens each), a keys CTA spanning both
    ("w2_k2_two_sort_chunks", 2, 16, [1100, 700], 2, 0, 64, "aligned", "expert", torch.int64,
     "moderate_skew"),
    ("w1_k8_ntt1024", 1, 16, [300], 8, 0, 128, "auto", "remote_first", torch.int32,
     "stress_skew"),
]


@pytest.mark.parametrize("name,W,E,tokens,k,owner,tile_tokens,layout,order,dtype,mode", CASES,
                         ids=[c[0] for c in CASES])
def test_emulated_tables_equal_the_torch_path(monkeypatch, name, W, E, tokens, k, owner,
                                              tile_tokens, layout, order, dtype, mode):
    ids, counts = _world(W, E, tokens, k, mode, seed=W + owner)
    mine = ids[owner].to(dtype)
    T = mine.shape[0]
    plan = plan_combine(counts, owner, tile_m=64, mgb=2, max_rows=W * max(tokens) * k,
                        validate=False, layout=layout, impl="torch", order=order)
    want = ordered_routes_device(mine, counts, plan, tile_tokens=tile_tokens, validate=True,
                                 impl="torch")
    tables, seg_inc, seg_count, rows, launches = emulated_tables(monkeypatch, mine, counts,
                                                                 plan, tile_tokens)
    entries = [e for e, *_ in launches]
    if T:  # the senders' plans, prepare's two, then keys, sort, tiles, compact
        assert len(entries) == 7 and all(e.startswith("kernel_cutlass_") for e in entries), \
            entries
        if tile_tokens * k < 1024:
            tiles_block = launches[5][2]
            assert tiles_block == max(32, 1 << (tile_tokens * k - 1).bit_length()) < 1024
        ref_rows, _ = prepare_routes_torch(mine, E, W, owner, False, plan)
        assert torch.equal(rows, ref_rows), name
    else:  # no token: the senders' plans only (tile_start / dep_start zeroed on the stream)
        assert len(entries) == 1, entries
    bad = [n for n, t in want.tables.items()
           if tables[n].dtype != torch.int32 or not torch.equal(tables[n], t)]
    assert not bad, (name, {n: (tables[n].tolist(), want.tables[n].tolist()) for n in bad})
    assert seg_count.dtype == torch.int32 and torch.equal(seg_count, want.seg_count), \
        (name, seg_count.tolist(), want.seg_count.tolist())
    for s, n in enumerate(want.seg_count.tolist()):
        assert torch.equal(seg_inc[s, :n], want.seg_inc[s, :n]), (name, s)
        # past rank s's own segments the kernels write nothing, the poison stays (the owner's
        # row: its segments all go to the others, 0 each, outside the valid prefix of 0)
        if s == owner:
            n = int(plan.num_segments)
            assert bool((seg_inc[s, :n] == 0).all()), (name, s, seg_inc[s, :n].tolist())
        assert bool((seg_inc[s, n:] == POISON[torch.int64]).all()), (name, s)


def test_emulated_seg_add_adds_each_senders_prefix(monkeypatch):
    """begin_call's per-segment advance (``OrderedRoutesKernel.seg_add``, a (G, W) grid: CTA
    (g, s) on row s) equals ``add_seg_inc``'s CPU path: each row's prefix added, every other
    word of seg_expected as it was (seg_count 0, full and in between; S over one CTA's
    stride)."""
    from moe_overlap.combine.ordered_routes import add_seg_inc
    g = torch.Generator().manual_seed(3)
    W, S = 4, 1500
    exp = torch.randint(-1 << 40, 1 << 40, (W, S), generator=g)
    inc = torch.randint(-1 << 40, 1 << 40, (W, S), generator=g)
    cnt = torch.tensor([0, S, 1029, 7], dtype=torch.int32)
    want = exp.clone()
    add_seg_inc(want, inc, cnt)
    got = exp.clone()
    with emulated_device(monkeypatch) as dev:
        ork.OrderedRoutesKernel().seg_add(got, inc, cnt)
    (entry, grid, block, smem), = dev.launches
    assert grid[1] == W and grid[0] >= 1, grid
    assert torch.equal(got, want)


# ---- the emulator's instructions these kernels added -------------------------------------------
_UNIT_PTX = """
.visible .entry unit(
    .param .u64 unit_param_0
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<40>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [unit_param_0];
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ctaid.y;
    mov.u32 %r4, %nctaid.y;
    rem.u32 %r5, %r1, 3;
    match.any.sync.b32 %r6, %r5, -1;
    mov.b32 %r7, -2130771710;
    mov.b32 %r8, 16909060;
    dp4a.s32.u32 %r9, %r7, %r8, 1000;
    dp4a.u32.u32 %r10, %r7, %r8, 1000;
    dp4a.u32.s32 %r11, %r8, %r7, 1000;
    mov.b32 %r12, 286331153;
    mov.b32 %r13, 572662306;
    mov.b64 %rd2, {%r12, %r13};
    mov.b64 {_, %r14}, %rd2;
    mov.b64 {%r15, _}, %rd2;
    setp.ne.s32 %p1, %r1, 0;
    mov.u32 %r20, 0;
    mov.u32 %r21, 4;
    mov.u32 %r22, 8;
    @%p1 bra $L_init;
    st.shared.u32 [%r20], 0;
    st.shared.u32 [%r21], 0;
    st.shared.u32 [%r22], 0;
$L_init:
    bar.sync 0;
    add.s32 %r23, %r1, -16;
    red.shared.max.s32 [%r20], %r23;
    red.shared.max.u32 [%r21], %r23;
    atom.shared.min.s32 %r24, [%r22], %r23;
    bar.warp.sync -1;
    bar.sync 0;
    ld.shared.u32 %r25, [%r20];
    ld.shared.u32 %r26, [%r21];
    ld.shared.u32 %r27, [%r22];
    mad.lo.s32 %r30, %r3, 2, %r2;
    mad.lo.s32 %r30, %r30, 32, %r1;
    mul.wide.u32 %rd3, %r30, 64;
    add.s64 %rd4, %rd1, %rd3;
    st.global.v4.u32 [%rd4], {%r6, %r9, %r10, %r11};
    st.global.v4.u32 [%rd4+16], {%r14, %r15, %r25, %r26};
    st.global.v4.u32 [%rd4+32], {%r27, %r3, %r4, %r2};
    st.global.u64 [%rd4+48], %rd2;
}
"""


def test_emulator_match_dp4a_mov_vectors_shared_min_max_and_grid_y():
    """The instructions the ordered routes' kernels brought to tests/ptx_emulator.py, against
    values worked out by hand from the PTX ISA's definitions: match.any.sync (the lanes of equal
    value), dp4a (a's bytes signed or not per its type: 0x80FF0102 is 2, 1, -1, -128 signed or
    2, 1, 255, 128 unsigned; b = 0x01020304 is 4, 3, 2, 1), mov.b64 pack / unpack (low part
    first, `_` a sink), red / atom min / max on shared words (signed for .s32, unsigned for
    .u32: -1 is the largest u32), bar.warp.sync, %ctaid.y / %nctaid.y of a (2, 3) grid."""
    em = Emulator(_UNIT_PTX, 1 << 16, shared_bytes=16)
    em.launch((2, 3), 32, [0x1000])
    for y in range(3):
        for x in range(2):
            for tid in range(32):
                w = em.read_words(0x1000 + 64 * ((y * 2 + x) * 32 + tid), 14)
                match = sum(1 << j for j in range(32) if j % 3 == tid % 3)
                assert w[0] & 0xFFFFFFFF == match
                assert w[1] == 1000 + 2 * 4 + 1 * 3 - 1 * 2 - 128 * 1
                assert w[2] == 1000 + 2 * 4 + 1 * 3 + 255 * 2 + 128 * 1
                assert w[3] == 1000 + 4 * 2 + 3 * 1 - 2 * 1 - 1 * 128  # b's bytes signed
                assert (w[4], w[5]) == (0x22222222, 0x11111111)
                assert (w[6], w[7] & 0xFFFFFFFF, w[8]) == (15, 0xFFFFFFFF, -16)
                assert (w[9], w[10], w[11]) == (y, 3, x)
                assert em.read_words(0x1000 + 64 * ((y * 2 + x) * 32 + tid) + 48, 1, 64) == \
                    [0x2222222211111111]
