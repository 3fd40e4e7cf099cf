"""Shared test machinery: markers (skips that say why), one multi-process spawn helper, and the
PTX / SASS helpers of the compile tests.

Markers (registered in pyproject.toml; the skips below are applied here, so a test only names
what it needs):
- ``gpu``: needs a CUDA GPU; skipped without one.
- ``two_gpus``: needs 2 GPU ranks: 2 CUDA GPUs (one rank per GPU), or one GPU with
  ``MOE_OVERLAP_SHARE_GPU=1`` (the ranks run as processes sharing it: ``scripts/gpu_check.sh
  ranks`` starts MPS and sets it); skipped otherwise.
- ``compile``: compiles CuTe DSL kernels for sm_90a (no GPU needed); skipped without
  nvidia-cutlass-dsl.

Multi-process tests: ``spawn_ranks(fn, world, *args, backend=...)`` (also as the fixture
``spawn_ranks``) runs ``fn(rank, world, *args)`` on ``world`` processes joined by a process
group: gloo on the CPU, NCCL with one GPU per rank (``backend="auto"`` picks NCCL where there are
enough GPUs). A failure on a rank raises with its traceback; ``join_timeout_s`` turns a hang into
a failure naming the ranks. ``single_rank_json(worker)`` runs a one-rank worker that records
its checks as JSON (the single-GPU fault tests); ``require_module(gpus)`` is the module-level
skip of the combine's GPU test files.

Nothing is written into the repository: CuTe DSL's dumps and Hypothesis's database go to a
temporary folder (below), and a run that leaves a new file in the repository root fails.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------ scratch, not the repo
# CuTe DSL dumps the PTX / cubin it keeps into CUTE_DSL_DUMP_DIR (default: the working folder,
# read once per process, so a test's monkeypatch.setenv after the first compile moves nothing),
# and Hypothesis keeps its example database in HYPOTHESIS_STORAGE_DIRECTORY (default:
# ./.hypothesis). Unless the caller set them, both go to one temporary folder per run, removed at
# the end; spawned ranks inherit the variables (and so make no folder of their own).
_SCRATCH_VARS = {"CUTE_DSL_DUMP_DIR": "cute_dsl_dump", "HYPOTHESIS_STORAGE_DIRECTORY": "hypothesis"}
_SCRATCH = None
if any(not os.environ.get(v) for v in _SCRATCH_VARS):
    _SCRATCH = tempfile.mkdtemp(prefix="moe_overlap_tests_")
    for _var, _sub in _SCRATCH_VARS.items():
        if not os.environ.get(_var):
            os.environ[_var] = os.path.join(_SCRATCH, _sub)
            os.makedirs(os.environ[_var])
# what the repository root holds before any test runs: the run fails if a test adds to it
_ROOT_BEFORE = set(os.listdir(REPO))
# pytest's own cache (-p no:cacheprovider: none) and coverage's data file (pytest --cov)
_ROOT_ALLOWED = {".pytest_cache", ".coverage"}


def _cuda_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken torch install: no GPU tests
        return 0


SHARE_GPU_ENV = "MOE_OVERLAP_SHARE_GPU"


def share_gpu() -> bool:
    """Multi-rank GPU tests may run their ranks as processes sharing the GPUs there are."""
    import os
    return os.environ.get(SHARE_GPU_ENV) == "1"


def gpu_ranks_available(world: int) -> bool:
    """``world`` GPU ranks can run here: one GPU each, or sharing (``share_gpu``)."""
    n = _cuda_count()
    return n >= world or (n >= 1 and share_gpu())


def ranks_share_gpus(world: int) -> bool:
    """``world`` GPU ranks of ``spawn_ranks(backend="nccl")`` run as processes sharing GPUs here
    (fewer GPUs, ``share_gpu``): their symmetric buffers then come from NVSHMEM (the FFN's band
    all-reduce included: torch symmetric memory refuses ranks on one device)."""
    return _cuda_count() < world and share_gpu()


def require_symmetric(world: int) -> None:
    """Skip (with the reason) where ``world`` ranks would share GPUs without nvshmem4py, which
    their symmetric allocations need; one rank per GPU needs nothing more."""
    if ranks_share_gpus(world):
        pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed (ranks sharing "
                                                   "a GPU allocate symmetric memory with it)")


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pytest_configure(config):
    for line in ("gpu: needs a CUDA GPU (skipped where none)",
                 "two_gpus: needs 2 CUDA GPUs, one rank each (skipped with fewer)",
                 "compile: compiles CuTe DSL kernels for sm_90a without a GPU (needs "
                 "nvidia-cutlass-dsl)"):
        config.addinivalue_line("markers", line)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when tests left files in the repository root (they write to tmp_path)."""
    new = sorted(set(os.listdir(REPO)) - _ROOT_BEFORE - _ROOT_ALLOWED)
    if not new:
        return
    msg = (f"tests wrote into the repository root {REPO}: {', '.join(new)} (write to tmp_path; "
           "the scratch folders are set in tests/conftest.py)")
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(msg, red=True, bold=True)
    else:
        print(msg, file=sys.stderr)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    if _SCRATCH is not None:
        shutil.rmtree(_SCRATCH, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    gpus = _cuda_count()
    cutlass = _has("cutlass")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_two = pytest.mark.skip(reason=f"needs 2 CUDA GPUs ({gpus} visible), or one with "
                                       f"{SHARE_GPU_ENV}=1 (ranks sharing it)")
    skip_compile = pytest.mark.skip(reason="needs nvidia-cutlass-dsl (not installed)")
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(skip_gpu)
        if "two_gpus" in item.keywords and not gpu_ranks_available(2):
            item.add_marker(skip_two)
        if "compile" in item.keywords and not cutlass:
            item.add_marker(skip_compile)


# ------------------------------------------------------------------------ multi-process runs
def spawn_ranks(fn, world: int, *args, backend: str = "gloo", timeout_s: float | None = None,
                join_timeout_s: float | None = None, hard_exit: bool = False,
                expect_killed: tuple = ()):
    """``fn(rank, world, *args)`` on ``world`` processes (``moe_overlap.launch.spawn``); returns
    the list of per-rank results. backend: "gloo" (CPU), "nccl" (GPU ranks: rank r on GPU r
    where there are ``world`` GPUs, else, with ``MOE_OVERLAP_SHARE_GPU=1``, ranks sharing the
    GPUs over gloo: ``moe_overlap.launch`` backend "cuda") or "auto" (GPU ranks where they can
    run, else gloo on the CPU). A rank's device is ``moe_overlap.launch.rank_device()``. fn must
    be a module-level function (the processes are spawned and import it by name).
    expect_killed: ranks the test kills with SIGKILL (``moe_overlap.launch.spawn``)."""
    from moe_overlap.launch import spawn
    if backend == "auto":
        backend = "nccl" if _cuda_count() >= 1 and gpu_ranks_available(world) else "gloo"
    if backend == "nccl":
        if not gpu_ranks_available(world):
            pytest.skip(f"needs {world} CUDA GPUs for {world} GPU ranks ({_cuda_count()} "
                        f"visible), or one with {SHARE_GPU_ENV}=1")
        backend = "nccl" if _cuda_count() >= world else "cuda"
    return spawn(fn, world, *args, backend=backend, timeout_s=timeout_s,
                 join_timeout_s=join_timeout_s, hard_exit=hard_exit, expect_killed=expect_killed)


# (W, transport) of the overlapped dispatch's and layer's GPU tests: both sends at W = 2 and 4
WORLD_TRANSPORTS = [(2, "nvlink"), (2, "nvshmem"), (4, "nvlink"), (4, "nvshmem")]


def world_transport_id(param) -> str:
    return f"W{param[0]}-{param[1]}"


def spawn_over_transport(worker, param):
    """``worker(rank, W, transport)`` on W GPU ranks (``spawn_ranks``, skipping where they cannot
    run); each rank's result names the transport its send used (``"transport"``), which must be
    the one asked for."""
    W, transport = param
    # MOE_TEST_JOIN_TIMEOUT_S: a device call shorter than the default turns a hang into an error
    join_s = float(os.environ.get("MOE_TEST_JOIN_TIMEOUT_S", "540"))
    res = spawn_ranks(worker, W, transport, backend="nccl", join_timeout_s=join_s, hard_exit=True)
    assert all(r["transport"] == transport for r in res)
    return res


def require_module(gpus: int, nvshmem: bool = True):
    """Module-level skip of a GPU test file of the combine, called at import: fewer than
    ``gpus`` CUDA GPUs, nvidia-cutlass-dsl missing or (``nvshmem``, default) nvshmem4py missing,
    each with its reason. ``nvshmem=False``: files that never touch NVSHMEM (the band
    all-reduce's) do not skip without it."""
    import sys
    # pytest reports this line as the skip's place: the reason names the calling file
    where = sys._getframe(1).f_globals.get("__name__", "?")
    if not gpu_ranks_available(gpus):
        need = "a CUDA GPU" if gpus == 1 else f"{gpus} CUDA GPUs (or one, {SHARE_GPU_ENV}=1)"
        pytest.skip(f"{where}: needs {need}", allow_module_level=True)
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    if nvshmem:
        pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")


def chained_launch_args(comp, s, M: int, P: int, hidden: int, N: int, b1_dtype=None):
    """``ChainedFFNCompute._cute_args`` on zero CPU tensors for schedule ``s`` of an M x P
    call (zero weights, b1 given in ``b1_dtype``, fp32 if None, a private flag pair): (args,
    ints), what the compile tests pass to ``_compiled_for`` so that __call__'s conversion
    compiles without a GPU."""
    import torch
    bf, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    x, w1, w2 = torch.zeros(M, P, **bf), torch.zeros(P, hidden, **bf), torch.zeros(hidden, N, **bf)
    ring = torch.zeros(comp.ring_rows(M, P, hidden, N, s.grid), hidden, **bf)
    b1 = torch.zeros(hidden, dtype=b1_dtype or torch.float32)
    return comp._cute_args(x, w1, b1, w2, ring, torch.zeros(M, N, **bf),
                           s.tile_table().reshape(-1).contiguous(),
                           torch.zeros(1 + 2 * s.blocks, **i32), torch.zeros(s.blocks, **i32),
                           torch.ones(1, **i32), torch.zeros(8, dtype=torch.int64), s.blocks,
                           s.ring, s.grid)


BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """bench/<name>.py as a module (the benches are scripts, not a package); bench/ goes on
    sys.path first, since benches import their siblings (bench_ffn's SHAPES, make_comp)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bitwise_equal(a, b) -> bool:
    """Two 16-bit float tensors (bf16 / fp16) of one shape holding the same bits (NaNs
    included: an equal-by-value check would miss a NaN in both or a -0 against 0)."""
    import torch
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def on_every_rank(step, group=None):
    """``step()`` on this rank, then the ranks agree (``moe_overlap.combine.checks.
    agree_on_error``, one all-reduce): where it raised on any rank, every rank raises (the failed
    rank its own error, the others PeerInputError naming it). A spawned rank calls this around a
    step that can fail on one rank only (a CUDA graph's capture or replay) before the next host
    collective: otherwise its peers wait in that collective for a rank that left, until the
    process group's timeout (30 minutes by default). Returns ``step()``'s value."""
    from moe_overlap.combine.checks import agree_on_error
    err, out = None, None
    try:
        out = step()
    except Exception as e:  # noqa: BLE001 - every kind of failure is agreed on, then raised
        err = e
    agree_on_error(err, group)
    return out


def agreed_graph(step):
    """A CUDA graph of ``step()`` (spawned GPU ranks): one warm-up call on a side stream
    (compiles, allocates; a first call's barriers are there), then the capture (no collective
    inside, so it can fail on one rank alone), each agreed on every rank (``on_every_rank``).
    Returns (graph, step's output in the graph)."""
    import torch

    def warm():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()

    def capture():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return graph, out
    on_every_rank(warm)
    return on_every_rank(capture)


def agreed_replay(graph) -> None:
    """``graph.replay()`` and a synchronize, agreed on every rank (``on_every_rank``): call it
    before a host collective that a rank whose replay failed would never enter."""
    import torch

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    on_every_rank(replay)


def worker_error(e: BaseException) -> str:
    """What a spawned rank records for an exception it caught (type, message and the tail of the
    traceback), so that the test reading its JSON fails with the rank's own reason."""
    import traceback
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"


def record_single_rank(rank: int, world: int, port: int, outdir: str, body) -> None:
    """The body of a single-rank GPU worker (``single_rank_json``): GPU ``rank`` current, a
    one-rank NCCL group, ``body(res)`` filling the dict ``res`` (an exception it raises recorded
    as ``res["error"]``), ``res`` written to ``outdir/rank<rank>.json``, then ``os._exit(0)``
    (no NCCL / NVSHMEM teardown: their order can hang)."""
    import json
    import os

    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    res = {}
    try:
        body(res)
    except Exception as e:  # noqa: BLE001 - recorded for the test to name
        res["error"] = worker_error(e)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    os._exit(0)


def single_rank_json(worker, join_timeout_s: float = 540) -> dict:
    """Runs ``worker(0, 1, port, outdir)`` in one spawned process (a rank that records its checks
    in ``outdir/rank0.json`` and leaves with ``os._exit``, skipping the NCCL / NVSHMEM teardown)
    and returns that dict; ``{"error": ...}`` when the rank was killed after ``join_timeout_s``
    or died without writing it. outdir: ``$MOE_TEST_OUT`` if set, else a fresh temporary one."""
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp

    from moe_overlap.launch import free_port
    d = os.environ.get("MOE_TEST_OUT") or tempfile.mkdtemp()
    p = mp.get_context("spawn").Process(target=worker, args=(0, 1, free_port(), d))
    p.start()
    p.join(timeout=join_timeout_s)
    if p.is_alive():
        p.kill()
    path = os.path.join(d, "rank0.json")
    r = json.load(open(path)) if os.path.exists(path) else {
        "error": f"no result (rank 0 hung past {join_timeout_s} s or died, exit code "
                 f"{p.exitcode})"}
    print(json.dumps(r, indent=1))
    return r


@pytest.fixture(name="spawn_ranks")
def spawn_ranks_fixture():
    """The ``spawn_ranks`` helper as a fixture."""
    return spawn_ranks


# ------------------------------------------------------------------------ PTX / SASS helpers
def compile_ptx_cubin(launch, *args) -> tuple[str, bytes]:
    """``cute.compile`` a launcher keeping its PTX and cubin: (ptx text, cubin bytes)."""
    from moe_overlap.kernels.compile import compile_keep, kept_cubin, kept_ptx
    c = compile_keep(launch, *args)
    return kept_ptx(c), kept_cubin(c)


def compile_ptx(launch, *args) -> str:
    """``cute.compile`` a launcher keeping its PTX: the PTX text."""
    return compile_ptx_cubin(launch, *args)[0]


def sass(cubin: bytes) -> str:
    """SASS text of a cubin (nvdisasm; raises, not skips, when it or the cubin is missing)."""
    from moe_overlap.kernels.compile import require_nvdisasm, sass_of
    if not cubin:
        raise RuntimeError("CuTe DSL returned no cubin")
    return sass_of(cubin, require_nvdisasm())


def ptx_body(ptx: str) -> str:
    """The PTX after the first ``.entry`` (the kernel body, without the module header)."""
    return ptx.split(".entry", 1)[1]


def nvshmem_consumer_body(**options) -> str:
    """PTX of the consumer's nvshmem transport (sm_90a), from its entry to the entry's closing
    brace (the NVSHMEM device functions linked in follow it). Skips where nvshmem4py is not
    installed; installed without its device bitcode: an error."""
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    import nvshmem.core
    import torch
    nvshmem.core.find_device_bitcode_library(arch="90")
    from moe_overlap.combine.consumer import (build_consumer, consumer_example_args,
                                              use_sm90_nvshmem_bitcode)
    if not torch.cuda.is_available():  # as compile_consumer: no GPU to pick the bitcode by
        use_sm90_nvshmem_bitcode()
    body = ptx_body(compile_ptx(build_consumer("nvshmem", **options), *consumer_example_args()))
    return body[:body.index("\n}\n")]


NVSHMEM_CALLS = (("signal_op", "signal"), ("put_signal_nbi", "put"), ("transfer_fence", "fence"),
                 ("transfer_quiet", "quiet"))


def nvshmem_calls(body: str) -> list[tuple[int, str]]:
    """(offset, kind) of the NVSHMEM device calls in a PTX body, in order, kind one of
    NVSHMEM_CALLS' names: direct calls by name, indirect ones (call %rdN) through the function
    address a mov.b64 put in that register."""
    import re
    addr, out = {}, []
    for m in re.finditer(r"mov\.b64\s+(%rd\d+),\s*([A-Za-z_$][\w$]*);"
                         r"|\bcall(?:\.uni)?\s+(?:\([^)]*\),\s*)?(%rd\d+|[A-Za-z_$][\w$]*)", body):
        if m.group(1):
            addr[m.group(1)] = m.group(2)
            continue
        callee = addr.get(m.group(3), m.group(3))
        kind = next((k for sub, k in NVSHMEM_CALLS if sub in callee), None)
        if kind:
            out.append((m.start(), kind))
    return out
