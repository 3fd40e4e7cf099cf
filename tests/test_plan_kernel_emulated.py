"""The planner kernel's compiled PTX run on the host (tests/ptx_emulator.py), against the closed
forms (plan_closed_form.py, equal to the torch planner field by field: test_plan_kernel_compile):
what the GPU tests check, on a machine without a GPU, for the cases where a GPU run disagreed.

The overflow plan (validate=False counts the capacity cannot hold) once left its segment fields
unwritten in the kernel while the closed forms and the torch planner say -1 (session 21: rank 1
of tests/test_ranks_faults_gpu.py's garbage fault; bench/NOTES.md). The buffer starts poisoned,
so an unwritten word shows; poisoned guards around it show a word written outside; each plan
word must be written by one CTA only (CTA 0 and the tail CTAs in one launch, no order between
them on a GPU).
"""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)

from moe_overlap.combine.plan import band_capacity_for  # noqa: E402
from moe_overlap.combine.plan_closed_form import closed_form_plan  # noqa: E402
from conftest import compile_ptx  # noqa: E402

pytestmark = pytest.mark.compile

POISON, GUARD = 0x5A5A5A5A, 256  # words
_PTX = {}


def _ptx(counts_64, E, El, order):
    from moe_overlap.combine.plan_kernel import PlanKernel, build_plan_kernels, plan_example_args
    key = PlanKernel.variant(counts_64, E, El, order)
    if key not in _PTX:
        _PTX[key] = compile_ptx(build_plan_kernels(*key), *plan_example_args())
    return _PTX[key]


def emulated_plan(counts, rank, tile_m, mgb, max_rows, layout, order):
    """(plan tensors by name, guards intact, words written by more than one CTA) of the
    kernel's PTX run as PlanKernel.__call__ launches it, on a poisoned buffer."""
    from ptx_emulator import Emulator
    from moe_overlap.combine.plan_kernel import _LAYOUT_CODE, TAIL_WORDS_PER_CTA, _Layout
    W, E = counts.shape
    El = E // W
    B = band_capacity_for(max_rows, El, W, tile_m)
    S = B + E
    lay = _Layout(W, E, El, B, S)
    c64 = counts.dtype == torch.int64
    em = Emulator(_ptx(c64, E, El, order), 1 << 20)
    c_at, out_at = 0x1000, 0x10000
    em.write_words(c_at, counts.reshape(-1).tolist(), 64 if c64 else 32)
    em.write_words(out_at - 4 * GUARD, [POISON] * (GUARD + lay.total + GUARD))
    tail_ctas = max(1, min(64, -(-max(B, S) // TAIL_WORDS_PER_CTA)))
    em.launch(1 + tail_ctas, 1024, [c_at, out_at, W, E, El, rank, tile_m.bit_length() - 1, mgb,
                                    _LAYOUT_CODE[layout], B, S])
    buf = torch.tensor(em.read_words(out_at, lay.total), dtype=torch.int32)
    guards = em.read_words(out_at - 4 * GUARD, GUARD) + em.read_words(out_at + 4 * lay.total,
                                                                       GUARD)
    shared = [(a - out_at) // 4 for a, ctas in em.writers.items() if len(ctas) > 1]
    return (lay.views(buf, W, E, El, B, S), all(g == POISON for g in guards), shared, B)


def _faults_test_counts():
    # tests/test_ranks_faults_gpu.py, garbage fault: W = 2, E = 8, seed 2, max_rows 1024
    return torch.randint(0, 1 << 20, (2, 8), generator=torch.Generator().manual_seed(2))


def _negative_counts():
    c = torch.randint(0, 3, (2, 8), generator=torch.Generator().manual_seed(7))
    c[1, 5] = -5  # rank 1's expert 1, from source 1
    return c


CASES = [  # (name, counts, rank, layout, max_rows)
    ("faults_test_rank1_int64", _faults_test_counts(), 1, "auto", 1024),
    ("faults_test_rank0_int32", _faults_test_counts().to(torch.int32), 0, "aligned", 1024),
    ("negative_rank1", _negative_counts(), 1, "packed", 1024),
    ("valid_rank1", torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(5)),
     1, "auto", 4000),
]


@pytest.mark.parametrize("order", ["remote_first", "expert"])
@pytest.mark.parametrize("name,counts,rank,layout,max_rows", CASES, ids=[c[0] for c in CASES])
def test_emulated_plan_kernel_equals_the_closed_forms(name, counts, rank, layout, max_rows,
                                                      order):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    got, guards_ok, shared, B = emulated_plan(counts, rank, 128, 2, max_rows, layout, order)
    ref = closed_form_plan(counts, rank, 128, 2, B, layout, order)
    bad = {n: (got[n].reshape(-1).tolist(), t.reshape(-1).tolist()) for n, t in ref.items()
           if not torch.equal(got[n].reshape(t.shape), t)}
    assert not bad, (name, order, bad)
    assert guards_ok, (name, order)
    assert not shared, (name, order, "plan words written by two CTAs", shared[:16])
    overflow = not name.startswith("valid")
    assert (not 0 <= int(got["num_bands"]) <= B) == overflow, (name, int(got["num_bands"]), B)
