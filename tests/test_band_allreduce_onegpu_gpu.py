"""The band all-reduce's G ranks emulated on ONE GPU (``band_allreduce.EmulatedRanks``: G buffer
sets on one device, peer tables of their addresses, rank r's kernel on stream r, all launched
concurrently, world * ccta <= SMs). Each rank is a real ``BandAllReduce`` (same views, tables,
checks, variant and launch as on a group), so this runs the fp32 and the (never yet run) bf16
modes' kernels and host launch path without a second GPU. Not covered: NVLink and separate
GPUs' caches (all ranks share one L2; see the EmulatedRanks docstring).

    CUDA_MODULE_LOADING=EAGER python3 -m pytest -q tests/test_band_allreduce_onegpu_gpu.py

Cases (tests/band_allreduce_onegpu_cases.py; the compile test builds the same variants):
  - standalone calls (producer=False), bf16 and fp32, G = 2 / 4, M never a multiple of
    band_rows, N % 8 == 0 (N / 8 odd too), act2 none / relu (silu within tolerance), b2 None /
    [N] / per band: four calls per set of ranks (M, M, fewer rows, M), fresh random partials
    each, outputs and the rows past M poisoned first. Each call: error words clear, output
    bitwise equal on every rank, no NaN; bf16: bitwise equal to ``emulate_band_allreduce_bf16``
    (and ``bf16_allreduce_reference``), every rank's buffer holding the final rows, the rows
    past M untouched; fp32: within one bf16 rounding of the float64 sum, bitwise equal to
    ``emulate_band_allreduce``, accumulator rows zeroed, the rows past M untouched. After the
    calls every rank's expected / arrive / done counters equal G x the calls that covered the
    band (nothing reset, nothing stale).
  - producer mode: the all-reduce launched first, a side stream stores the partials ~20 ms
    later and then raises band_ready (epoch advanced per call): exact; the same with the
    deliberately broken ordering (``_test_skip_ready_wait``: no wait for band_ready) must read
    the NaN poison, so the check fails as it should.
  - one rank's expected counter a call ahead (counters out of step): that rank records the
    arrive timeout (observed 2G, expected 3G), the others a timeout too, within the short bound.
  - one rank never launched: every launched rank records the arrive timeout naming itself, the
    band and the counts (G - 1 of G arrivals), in about the timeout; nothing hangs.
"""
import time
import zlib

import pytest
import torch

from conftest import require_module

pytestmark = pytest.mark.gpu

require_module(gpus=1, nvshmem=False)

from band_allreduce_onegpu_cases import (CASES, COUNTER_CASES, ERROR_SHAPE,  # noqa: E402
                                         MISSING_RANK_CASES, PRODUCER_CASES, PRODUCER_SHAPE,
                                         SHORT_TIMEOUT_NS, TIMEOUT_NS, call_rows)
from moe_overlap.ffn import band_allreduce as B  # noqa: E402
from moe_overlap.ffn.activations import activation  # noqa: E402

NAN = float("nan")
SENTINEL = 7.0  # fp32 accumulator rows past M
TOL = 1e-2  # one bf16 rounding (relative, with a 1e-2 floor), the fast-math act2s


def _case_id(c):
    partial, G, M, N, act2, bias, band_rows, ready_rows, ccta = c
    return f"{partial}-G{G}-{M}x{N}-{act2}-b2{bias or 'none'}-br{band_rows}-cc{ccta}"


def _partials(er, M, g):
    """Fresh random partials, one per rank, on the GPU (bf16 x 2 / fp32)."""
    if er.partial_dtype == "bf16":
        return [(torch.randn(M, er.N, generator=g, device=er.device) * 2).to(torch.bfloat16)
                for _ in range(er.world)]
    return [torch.randn(M, er.N, generator=g, device=er.device) for _ in range(er.world)]


def _load(er, parts, M):
    """Poison every rank's buffer, then its partial into rows [0, M)."""
    for d, p in zip(er.data, parts):
        d.fill_(NAN if er.partial_dtype == "bf16" else SENTINEL)
        d[:M].copy_(p)


def _nan_outs(er, M):
    return [torch.full((M, er.N), NAN, dtype=torch.bfloat16, device=er.device)
            for _ in range(er.world)]


def _rel(out, ref):
    return ((out.double() - ref.double()).abs() / (ref.double().abs() + 1e-2)).max().item()


def _assert_clear(er):
    words = er.error_words()
    msgs = [B.describe_error(w) for w in words]
    assert not any(msgs), msgs
    return words


def _assert_rank_equal(outs):
    for r, o in enumerate(outs):
        assert not bool(o.isnan().any()), f"rank {r}: NaN in the output"
        assert torch.equal(outs[0], o), f"rank {r}'s output differs from rank 0's"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_emulated_allreduce(case):
    partial, G, M, N, act2, bias, band_rows, ready_rows, ccta = case
    bf16 = partial == "bf16"
    er = B.EmulatedRanks(G, M, N, partial=partial, act2=act2, band_rows=band_rows,
                         ready_rows=ready_rows, ccta=ccta, b2_per_band=bias == "per_band",
                         timeout_ns=TIMEOUT_NS)
    g = torch.Generator(device=er.device).manual_seed(zlib.crc32(_case_id(case).encode()))
    b2 = None
    if bias is not None:
        shape = er[0].b2_shape(M)
        b2 = (torch.randn(*shape, generator=g, device=er.device) * 0.5).to(torch.bfloat16)
    b2_cpu = None if b2 is None else b2.cpu()
    rr = ready_rows if bias == "per_band" else None
    exact = act2 in ("none", "relu")
    covered = torch.zeros(er[0].max_bands, dtype=torch.int32)
    for call, Mc in enumerate(call_rows(M)):
        where = f"call {call} (M={Mc})"
        parts = _partials(er, Mc, g)
        _load(er, parts, Mc)
        outs = _nan_outs(er, Mc)
        er(Mc, b2=b2, outs=outs)
        _assert_clear(er)
        _assert_rank_equal(outs)
        out = outs[0].cpu()
        nb = -(-Mc // band_rows)
        grid = min(ccta, nb)
        parts_cpu = [p.cpu() for p in parts]
        if bf16:
            model_outs, cov = B.emulate_band_allreduce_bf16([p.clone() for p in parts_cpu], Mc,
                                                            band_rows, b2_cpu, act2, grid, rr)
            assert bool((cov == 1).all()), where
            ref = B.bf16_allreduce_reference(parts_cpu, b2_cpu, act2, ready_rows=rr)
            if exact:
                assert torch.equal(model_outs[0], ref), where  # the model's own check
                assert torch.equal(out, model_outs[0]), (where, _rel(out, model_outs[0]))
            else:
                assert _rel(out, ref) < TOL, (where, _rel(out, ref))
            for r, d in enumerate(er.data):  # the final rows stored into every rank's buffer
                assert torch.equal(d[:Mc], outs[0]), (where, f"rank {r}'s buffer")
                assert bool(d[Mc:].isnan().all()), (where, f"rank {r}: rows past M written")
        else:
            s = sum(p.double() for p in parts_cpu)
            if b2_cpu is not None:
                s = s + b2_cpu.double()
            ref64 = activation(s, act2)
            assert _rel(out, ref64) < TOL, (where, _rel(out, ref64))
            if exact:
                model_outs, cov = B.emulate_band_allreduce([p.clone() for p in parts_cpu], Mc,
                                                           band_rows, b2_cpu, act2, grid)
                assert bool((cov == 1).all()), where
                assert torch.equal(out, model_outs[0]), (where, _rel(out, model_outs[0]))
            for r, d in enumerate(er.data):
                assert bool((d[:Mc] == 0).all()), (where, f"rank {r}: accumulator not zeroed")
                assert bool((d[Mc:] == SENTINEL).all()), (where, f"rank {r}: rows past M")
        covered[:nb] += 1
    want = covered * G  # every call covering band b advances each counter by G
    for r, ar in enumerate(er):
        for name in ("expected", "arrive", "done"):
            got = getattr(ar, name).cpu()
            assert torch.equal(got, want), (f"rank {r} {name}", got.tolist(), want.tolist())


@pytest.mark.parametrize("partial,G,broken", PRODUCER_CASES,
                         ids=[f"{p}-G{g}-{'broken' if b else 'ordered'}"
                              for p, g, b in PRODUCER_CASES])
def test_emulated_producer_ordering(partial, G, broken):
    from moe_overlap.timing import sleep_cycles_per_ms
    M, N, band_rows, ready_rows, ccta = PRODUCER_SHAPE
    er = B.EmulatedRanks(G, M, N, partial=partial, band_rows=band_rows, ready_rows=ready_rows,
                         ccta=ccta, timeout_ns=TIMEOUT_NS, _test_skip_ready_wait=broken)
    g = torch.Generator(device=er.device).manual_seed(G * 10 + broken)
    cur = torch.cuda.current_stream(er.device)
    prod = torch.cuda.Stream(device=er.device)
    sleep = int(20 * sleep_cycles_per_ms())
    # warm-up, nothing overlapped yet: every kernel the timed part runs is loaded (the epoch add,
    # the producer's sleep / copy / flag fill, the all-reduce); band_ready already holds epoch 1
    parts = _partials(er, M, g)
    with torch.cuda.stream(prod):
        torch.cuda._sleep(1000)
        for ar, p in zip(er, parts):
            ar._data[:M].copy_(p)
            ar.band_ready.fill_(1)
    torch.cuda.synchronize()
    warm = er(M, producer=True)  # (held until the kernels are done, like every output)
    _assert_clear(er)
    del warm
    results = []
    for call in range(2):
        epoch = call + 2
        parts = _partials(er, M, g)
        for d in er.data:
            d.fill_(NAN)
        outs = _nan_outs(er, M)
        prod.wait_stream(cur)  # the poison and the inputs before the producer's stores
        er(M, outs=outs, producer=True)  # forks from cur: starts now, epoch -> call + 2
        with torch.cuda.stream(prod):  # the producer: late partials, then the ready flags
            torch.cuda._sleep(sleep)
            for ar, p in zip(er, parts):
                ar._data[:M].copy_(p)
                ar.band_ready.fill_(epoch)
        cur.wait_stream(prod)
        _assert_clear(er)
        parts_cpu = [p.cpu() for p in parts]
        if partial == "bf16":
            ref = B.bf16_allreduce_reference(parts_cpu)
            ok = all(torch.equal(o.cpu(), ref) for o in outs)
        else:
            ref = sum(p.double() for p in parts_cpu)
            ok = all(not bool(o.isnan().any()) and _rel(o.cpu(), ref) < TOL for o in outs)
        results.append(dict(call=call, ok=ok, nan=[bool(o.isnan().any()) for o in outs],
                            epoch=[int(ar.epoch.item()) for ar in er]))
        assert all(e == epoch for e in results[-1]["epoch"]), results[-1]
    if broken:  # read the poison before the producer stored anything: the check catches it
        assert not any(r["ok"] for r in results), results
    else:
        assert all(r["ok"] for r in results), results
        _assert_rank_equal(outs)


def _error_ranks(partial, G):
    M, N, band_rows, ccta = ERROR_SHAPE
    return B.EmulatedRanks(G, M, N, partial=partial, band_rows=band_rows, ccta=ccta,
                           timeout_ns=SHORT_TIMEOUT_NS), M


@pytest.mark.parametrize("partial,G", COUNTER_CASES)
def test_counter_out_of_step_times_out(partial, G):
    er, M = _error_ranks(partial, G)
    nb = -(-M // er.band_rows)
    g = torch.Generator(device=er.device).manual_seed(5)
    _load(er, _partials(er, M, g), M)
    outs = er(M)
    _assert_clear(er)  # one good call: every counter at G
    er[1].expected.add_(G)  # rank 1 a call ahead: waits for arrivals that never come
    _load(er, _partials(er, M, g), M)
    t0 = time.monotonic()
    outs = er(M, outs=_nan_outs(er, M))
    words = er.error_words()
    wall = time.monotonic() - t0
    msgs = [B.describe_error(w) for w in words]
    code, rank, band, _, observed, expected, elapsed, _ = words[1]
    assert (code, rank, observed, expected) == (B.ERR_ARRIVE_TIMEOUT, 1, 2 * G, 3 * G), msgs
    assert 0 <= band < nb and elapsed >= SHORT_TIMEOUT_NS, words[1]
    for r, w in enumerate(words):  # the others wait for rank 1's chunks (done) in vain
        assert w[0] in (B.ERR_ARRIVE_TIMEOUT, B.ERR_DONE_TIMEOUT) and w[1] == r, (r, msgs)
    assert f"rank 1, band {band}" in msgs[1], msgs[1]
    assert wall < SHORT_TIMEOUT_NS / 1e9 + 10, wall
    with pytest.raises(RuntimeError, match="emulated rank 1: band all-reduce timed out"):
        er.check()


@pytest.mark.parametrize("partial,G", MISSING_RANK_CASES)
def test_missing_rank_times_out(partial, G):
    er, M = _error_ranks(partial, G)
    nb = -(-M // er.band_rows)
    g = torch.Generator(device=er.device).manual_seed(6)
    _load(er, _partials(er, M, g), M)
    t0 = time.monotonic()
    outs = er(M, outs=_nan_outs(er, M), ranks=range(G - 1))  # rank G - 1 never launched
    words = er.error_words()
    wall = time.monotonic() - t0
    msgs = [B.describe_error(w) for w in words]
    for r in range(G - 1):
        code, rank, band, flag, observed, expected, elapsed, _ = words[r]
        assert (code, rank, observed, expected) == (B.ERR_ARRIVE_TIMEOUT, r, G - 1, G), msgs
        assert 0 <= band < nb and flag == band and elapsed >= SHORT_TIMEOUT_NS, words[r]
        assert "timed out waiting for every rank's partial" in msgs[r], msgs[r]
        assert f"rank {r}, band {band}: flag={G - 1}, expected>={G}" in msgs[r], msgs[r]
    assert words[G - 1][0] == 0, msgs  # the rank that never ran records nothing
    assert wall < SHORT_TIMEOUT_NS / 1e9 + 10, wall
