"""ccta never above what the transfer needs (issue 36), on the CPU:

- the analytic choice caps ccta at one consumer SM per piece of the bytes to move, and picks 0
  (no consumer) where nothing moves;
- ``CombineOptions.resolve``: a group of one rank without local copy resolves ccta="auto" to 0;
  with the local copy (the consumer copies every row) or more ranks, to a ccta >= 1; an explicit
  0 is refused wherever the consumer has something to move; a tuned entry still wins;
- ``OverlapCombine.forward`` at ccta 0 (host order, kernels replaced by recorders): no consumer
  launch, no side stream, the producer without band flags on every SM, the scale waiting on no
  counter, expected counts untouched, the epoch advanced; per-call ccta 0 refused elsewhere.
The GPU half (bitwise equal output, no consumer kernel): tests/test_no_consumer_gpu.py.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moe_overlap.combine.options import (CombineFacts, CombineOptions, min_ccta,
                                         producer_gemm_options)
from moe_overlap.combine.overlap import OverlapCombine
from moe_overlap.combine.tuning import (CCTA_CHOICES, PIECE_BYTES, TuneCache, analytic_choice,
                                        ccta_cap)

N, K = 4096, 2048
ONE = CombineFacts(world_size=1, hidden_size=K, out_features=N, experts_per_rank=32,
                   tile_m=128, rows=4096 * 8, device_name="FakeGPU", num_sms=132)


# ------------------------------------------------------------------------ the analytic cap
def test_cap_is_one_sm_per_piece_and_zero_without_bytes():
    rows_per_piece = PIECE_BYTES // (2 * N)
    assert ccta_cap(0, N) == 0
    assert ccta_cap(1, N) == 1
    assert ccta_cap(rows_per_piece, N) == 1
    assert ccta_cap(rows_per_piece + 1, N) == 2
    assert ccta_cap(10 * rows_per_piece, N) == 10


def test_analytic_choice_never_exceeds_the_cap():
    rows = 65536
    seen = set()
    for remote in [0, 1, 64, 128, 256, 512, 1024, 2048, 8192, 32768, 65536]:
        c, m = analytic_choice(rows, remote, N, K)
        seen.add(c)
        assert c <= ccta_cap(remote, N), (remote, c)
        assert (c == 0) == (remote == 0), (remote, c)
    # small transfers get fewer SMs than the smallest uncapped choice
    assert min(seen - {0}) < min(CCTA_CHOICES)
    assert analytic_choice(rows, 0, N, K) == (0, 1)


def test_cap_changes_nothing_where_it_does_not_bind():
    """Where the transfer holds more pieces than the largest choice, the choice is the one of
    the uncapped model (a 1-byte piece: a cap no choice reaches)."""
    for remote in (16384, 32768, 65536):
        assert ccta_cap(remote, N) > max(CCTA_CHOICES)
        assert analytic_choice(65536, remote, N, K) == analytic_choice(65536, remote, N, K,
                                                                       piece_bytes=1)


# ------------------------------------------------------------------------ resolution
def test_one_rank_without_local_copy_resolves_to_no_consumer(tmp_path):
    cache = TuneCache(str(tmp_path / "t.json"))
    got = CombineOptions().resolve(ONE, cache=cache)  # nvlink: local_copy auto -> False
    assert (got.ccta, got.local_copy) == (0, False)
    assert min_ccta(1, False) == 0
    # the consumer has something to move: at least one SM
    for opts in (CombineOptions(local_copy=True, copy="ldst"), CombineOptions(transport="nvshmem")):
        r = opts.resolve(ONE, cache=cache)
        assert r.local_copy and r.ccta >= 1, (opts, r.ccta)
    two = dataclasses.replace(ONE, world_size=2, experts_per_rank=16)
    assert CombineOptions().resolve(two, cache=cache).ccta >= 1
    # explicit values: 0 only where nothing moves; explicit ccta >= 1 still allowed at W = 1
    assert CombineOptions(ccta=0).resolve(ONE, cache=cache).ccta == 0
    assert CombineOptions(ccta=8).resolve(ONE, cache=cache).ccta == 8
    for facts, kw in ((two, {}), (ONE, dict(local_copy=True, copy="ldst"))):
        with pytest.raises(ValueError, match=r"ccta=0 must be an int in \[1, 131\] \(0, no"):
            CombineOptions(ccta=0, **kw).resolve(facts, cache=cache)
    # a tuned entry wins over the analytic 0 (auto: tuned, else the library's choice)
    cache.put(CombineOptions().tune_key(ONE), 12, 2)
    assert CombineOptions().resolve(ONE, cache=TuneCache(cache.path)).ccta == 12


def test_producer_options_beside_and_without_a_consumer():
    assert producer_gemm_options({}, 8) == {"tile_fetch": "dynamic"}  # the GEMM's clusters
    # every SM: the GEMM's clusters, the same fetch
    assert producer_gemm_options({}, 0) == {"tile_fetch": "dynamic", "signal": False}
    assert producer_gemm_options({}, 0, flags=True) == {"tile_fetch": "dynamic"}
    assert producer_gemm_options({"tile_fetch": "static"}, 0) == {"tile_fetch": "static",
                                                                  "signal": False}
    assert producer_gemm_options({"cluster_n": 2, "band_group": 4}, 8) == {"cluster_n": 2,
                                                                          "band_group": 4}
    # a tile walk the user names is kept as named, with no fetch of the library's added
    assert producer_gemm_options({"cluster_n": 1}, 8) == {"cluster_n": 1}
    assert producer_gemm_options({"cluster_slack": True}, 8) == {"cluster_slack": True}
    assert producer_gemm_options({"tile_fetch": "static"}, 8) == {"tile_fetch": "static"}
    assert producer_gemm_options({"band_group": 4}, 8) == {"band_group": 4,
                                                           "tile_fetch": "dynamic"}
    # a flag option of the user's does not stop the build without flags (GroupedGemm refuses
    # flag_warp without signal)
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    opts = producer_gemm_options({"flag_warp": True}, 0)
    assert opts == {"tile_fetch": "dynamic", "signal": False}
    GroupedGemm(**opts)


# ------------------------------------------------------------------------ the call at ccta 0
def _one_rank(monkeypatch, log, local_copy=False, ccta=0):
    from test_recover_cpu import _fake_combine
    ov, args = _fake_combine(log, monkeypatch=monkeypatch)
    ov.world_size = 1
    ov.options = SimpleNamespace(ccta=ccta, local_copy=local_copy, consumer_piece_rows=0)
    ov._warm = ov._prod_warm = True
    seen = {}
    ov.produce = lambda h, w, plan, y, ready, ccta=None, **kw: (
        log.append("produce"), seen.update(produce=dict(ccta=ccta, **kw)))
    launch = ov.scale.launch
    ov.scale.launch = lambda **kw: (seen.update(scale=kw), launch(**kw))
    h, w, plan, ids, gates = args
    routes = SimpleNamespace(rows=-1 - torch.arange(ids.numel(), dtype=torch.int32).view(
        ids.shape), plan=plan, num_tokens=ids.shape[0], ordered=None,
        expected_inc=torch.ones(2, dtype=torch.int64))
    return ov, (h, w, plan, ids, gates), routes, seen


def test_call_at_ccta_zero_launches_no_consumer(monkeypatch):
    from test_recover_cpu import _Stream
    import contextlib
    log = []
    s0 = _Stream(log, "s0")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: s0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    ov, args, routes, seen = _one_rank(monkeypatch, log)
    ov.expected.fill_(5)
    epoch0 = int(ov.epoch)
    log.clear()
    out = ov.forward(*args, routes=routes)
    assert log == ["produce", "scale"], log  # no begin_call, no consumer, no stream fork
    assert seen["produce"] == dict(ccta=0, flags=False)
    kw = seen["scale"]
    assert kw["counters"].numel() == 0 and kw["stream"] is s0 and kw["rows"] is routes.rows
    assert not kw.get("epoch_tags", False) and kw.get("err_peers") is None
    assert ov.expected.tolist() == [5] * ov.expected.numel()  # no arrival expected
    assert int(ov.epoch) == epoch0 + 1
    assert out.shape == (args[3].shape[0], ov.out_features)
    # the same layer with a per-call ccta ships as before (the tuner times candidates so),
    # after loading the consumer once, alone
    ov._consumer_warm = False
    ov._warmup_consumer = lambda: (log.append("consumer warm-up"),
                                   setattr(ov, "_consumer_warm", True))
    for call in range(2):
        log.clear()
        ov.forward(*args, routes=routes, ccta=4)
        assert "ship" in log and "begin" in log and log.index("produce") < log.index("ship")
        assert log.count("consumer warm-up") == (1 if call == 0 else 0), log
        assert call or log.index("consumer warm-up") < log.index("begin")


@pytest.mark.parametrize("world,local_copy", [(2, False), (1, True)])
def test_per_call_ccta_zero_refused_where_the_consumer_has_work(monkeypatch, world, local_copy):
    ov = object.__new__(OverlapCombine)
    ov.world_size, ov.num_sms = world, 132
    ov.options = SimpleNamespace(local_copy=local_copy)
    with pytest.raises(ValueError, match=r"ccta=0 must be an int in \[1, 131\]"):
        ov.check_ccta(0)
    assert ov.check_ccta(1) == 1
    ov.world_size, ov.options = 1, SimpleNamespace(local_copy=False)
    assert ov.check_ccta(0) == 0
