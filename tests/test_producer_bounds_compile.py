"""Compile-only (sm_90a, no GPU) checks of the producer GEMM's device bounds (issue 21) and of the
consumer wait that they rely on:

- the GEMM (default variant: clusters of 2 with the relay warp; clusters of 1 beside the consumer;
  no flags; group_by="expert" beside the consumer) builds with the checks: 64-bit range
  compares for num_bands and, per tile, the band id, expert and rows (and the group entry); the error recorded through the first-writer-wins CAS; the band-count check
  placed before any TMA load;
- the checks are per tile, not in the main loop: the SASS k loop (the smallest loop holding the
  HGMMAs) has no global load and no atomic;
- the consumer's band wait reads the error word inside its spin (a flag the producer refused
  never comes), so the wait ends at the error instead of at the timeout.
"""
import os
import re

import pytest

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx, ptx_body, sass  # noqa: E402

VARIANTS = {"default": {}, "beside": dict(cluster_n=1), "noflag": dict(signal=False),
            # groups cut at expert boundaries: the per-position tables and their checks
            "expert_beside": dict(cluster_n=1, group_by="expert")}


def _gemm_kernel_args(kw, N=1024, K=512):
    """The kernel object and fake arguments ``GroupedGemm.compile`` uses (to keep the cubin)."""
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    return GroupedGemm(**kw)._kernel(N), GroupedGemm.example_args(
        N, K, kw.get("group_by") == "expert")


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemm(request):
    from conftest import compile_ptx_cubin
    k, args = _gemm_kernel_args(VARIANTS[request.param])
    ptx, cubin = compile_ptx_cubin(k, *args)
    return request.param, ptx_body(ptx), cubin


def test_gemm_has_the_bounds_checks(gemm):
    name, body, _ = gemm
    # num_bands once, then band id / expert / rows per tile in each warp role's two tile picks
    # (the first tile and the next one), each an in_range_s64: lo <= v (setp.ge) and v < hi
    assert body.count("setp.lt.and.s64") >= 1 + 3 * 4, name
    # ERR_PRODUCER_BOUNDS through record_error's CAS: the band count (one thread of the grid)
    # and the TMA warp's per-band checks
    assert body.count("atom.relaxed.gpu.global.cas.b64") >= 2, name
    assert "fence.acq_rel.sys" in body
    # the band count is checked before the first TMA load or flag store
    first = body.index("setp.lt.and.s64")
    assert first < body.index("cp.async.bulk.tensor"), name
    if name != "noflag":
        assert first < body.index("st.release.gpu"), name
    else:
        assert "st.release.gpu" not in body


def _smallest_hgmma_loop(text):
    """SASS instructions of the smallest loop (backward branch) that holds an HGMMA."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines)
              if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if re.match(r"\s*/\*[0-9a-f]+\*/", x)]
            if any("HGMMA" in x for x in body) and (best is None or len(body) < len(best)):
                best = body
    return best


def test_checks_stay_out_of_the_k_loop(gemm):
    name, _, cubin = gemm
    loop = _smallest_hgmma_loop(sass(cubin))
    assert loop, f"{name}: no HGMMA loop found in the SASS"
    # global loads / atomics (the table reads, the error CAS, the flag count) stay outside
    bad = [x for x in loop if re.search(r"\b(LDG|ATOMG|ATOM|REDG|RED\.E)", x)]
    assert not bad, (name, bad)


def test_consumer_band_wait_polls_the_error_word():
    from moe_overlap.combine.consumer import build_consumer, consumer_example_args
    for copy in ("ldst", "tma"):
        body = ptx_body(compile_ptx(build_consumer("nvlink", copy=copy, local_copy=False),
                                    *consumer_example_args()))
        # the error word: once at kernel start, and in the band wait (before and in its spin)
        first_flag = body.index("ld.acquire.gpu.global.s32")
        after = body[first_flag:]
        assert body.count("ld.relaxed.gpu.global.s64") >= 3, copy
        assert "ld.relaxed.gpu.global.s64" in after, copy
