"""Compile-only checks (sm_90a, no GPU) of the ordered scale's table kernels
(combine/ordered_routes_kernel.py) and of begin_call's per-segment advance (``seg_add``): each
builds, keeps no local-memory stack, and its PTX carries what the design rests on.
"""
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)

from conftest import compile_ptx as _ptx, ptx_body  # noqa: E402

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def _cutlass():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize("counts_64,NE,NPS,by_expert", [(True, 512, 8, False),
                                                         (False, 64, 32, True)])
def test_senders_kernel_writes_every_segment_and_no_capacity_tail(counts_64, NE, NPS, by_expert):
    """A planning CTA per rank (block y) and the segments' int64 increments stored from one
    place, once per segment (no zero fill of the capacity: nothing past num_segments)."""
    from moe_overlap.combine.plan_kernel import build_plan_kernels, plan_example_args
    ptx = _ptx(build_plan_kernels(counts_64, NE, NPS, by_expert=by_expert, senders=True),
               *plan_example_args())
    plan = _ptx(build_plan_kernels(counts_64, NE, NPS, by_expert=by_expert),
                *plan_example_args())
    body = ptx_body(ptx)
    assert "%ctaid.y" in body and "%ctaid.y" not in ptx_body(plan)
    assert body.count("st.global.s64") == 1  # seg_inc: one store site, every segment
    assert "st.global.s64" not in ptx_body(plan)
    assert ".local" not in body and ".reqntid 1024" in ptx


@pytest.mark.parametrize("ids_64", [True, False])
def test_keys_kernel(ids_64):
    from moe_overlap.combine.ordered_routes_kernel import build_keys_kernel, keys_example_args
    body = ptx_body(_ptx(build_keys_kernel(ids_64), *keys_example_args()))
    assert "red.shared.max.s32" in body  # a token's key: the largest of its k
    assert "red.relaxed.gpu.global.add.s32" in body  # per-chunk bucket counts
    assert ("ld.global.s32" in body) and ".local" not in body


@pytest.mark.parametrize("NTT", [32, 512, 1024])
def test_tiles_and_compact_kernels(NTT):
    from moe_overlap.combine.ordered_routes_kernel import (build_tiles_kernels,
                                                           compact_example_args,
                                                           tiles_example_args)
    lt, lc = build_tiles_kernels(NTT)
    tiles = ptx_body(_ptx(lt, *tiles_example_args()))
    assert "st.shared.s64" in tiles and "ld.shared.s64" in tiles  # the bitonic sort's keys
    assert "shfl.sync.up.b32" in tiles  # the distinct codes' CTA scan
    assert ".local" not in tiles
    compact = ptx_body(_ptx(lc, *compact_example_args()))
    assert "ld.global.s64" in compact or "ld.global.b64" in compact
    assert compact.count("st.global.s32") >= 3 + 3 + 4  # codes, padding, both starts
    assert ".local" not in compact


def test_seg_add_kernel_strides_over_the_valid_prefix_only():
    """CTA (g, s): row s of the tables, bounded by seg_count[s] (a 32-bit load, clamped), a
    64-bit read-add-write per word; no barrier, nothing shared."""
    from moe_overlap.combine.ordered_routes_kernel import (build_seg_add_kernel,
                                                           seg_add_example_args)
    body = ptx_body(_ptx(build_seg_add_kernel(), *seg_add_example_args()))
    assert "%ctaid.y" in body and "%nctaid.x" in body
    assert "ld.global.s32" in body  # seg_count[s]
    assert body.count("st.global.s64") == 1 and "add.s64" in body
    assert "bar.sync" not in body and ".shared" not in body and ".local" not in body
