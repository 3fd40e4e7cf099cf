"""The overlapped dispatch's index math (moe_overlap/combine/dispatch_index.py: the send kernel's
per-destination compaction, batch by batch with per-warp ballots, and the expand kernel's
per-(expert, source) scan with its zero gaps) against `MoEDispatch`'s reference on gloo ranks:
bitwise at W = 2 and 4, random, skewed and duplicate routings, ranks with 0 tokens, a rank that
receives nothing, both plan layouts, rows past the plan's total; and the receive-slot layout."""
import pytest
import torch

from moe_overlap import MoEDispatch
from moe_overlap.combine import exchange_counts
from moe_overlap.combine.dispatch_index import dispatch_host, send_host, slot_layout
from moe_overlap.combine.plan import plan_combine
from moe_overlap.routing import route
from conftest import spawn_ranks

EL, D, K, T_MAX = 3, 16, 3, 80


def _ids(W, tokens, kind, seed):
    E = EL * W
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, T in enumerate(tokens):
        if kind == "skew":
            out.append(route(T, E, K, "stress_skew", seed=seed, rank=r)[0] if T else
                       torch.zeros(0, K, dtype=torch.long))
        elif kind == "dup":
            out.append(torch.randint(0, E, (T, K), generator=g))
        else:
            lo = EL if kind == "not_rank0" else 0
            out.append(torch.stack([lo + torch.randperm(E - lo, generator=g)[:K]
                                    for _ in range(T)]) if T else
                       torch.zeros(0, K, dtype=torch.long))
    return out


CASES = [(2, (70, 33), "uniform"), (2, (0, 65), "dup"), (4, (80, 0, 17, 64), "skew"),
         (4, (40, 77, 5, 1), "not_rank0"), (4, (0, 0, 0, 9), "uniform")]


def _worker(rank, W):
    res = []
    for ci, (w, tokens, kind) in enumerate(CASES):
        if w != W:
            continue
        all_ids = _ids(W, tokens, kind, seed=ci)
        xs = [torch.randn(T, D, generator=torch.Generator().manual_seed(50 + r)).to(
            torch.bfloat16) for r, T in enumerate(tokens)]
        counts = exchange_counts(all_ids[rank], EL * W)
        for layout in ("aligned", "packed"):
            plans = [plan_combine(counts, r, tile_m=64, layout=layout) for r in range(W)]
            rows = [p.row_capacity for p in plans]
            layer = MoEDispatch(EL * W, D, K, max_tokens_per_rank=T_MAX)
            want = layer(xs[rank], all_ids[rank], plans[rank], counts, rows=rows[rank])
            for threads in (32, 64):  # several batches and warps at these token counts
                got = dispatch_host(xs, all_ids, plans, counts, T_MAX, rows, threads)[rank]
                res.append((ci, layout, threads, bool(torch.equal(
                    got.view(torch.int16), want.view(torch.int16))),
                    int(plans[rank].total_rows), rows[rank]))
    return res


@pytest.mark.parametrize("W", [2, 4])
def test_host_mirror_of_the_device_dispatch_is_bitwise_the_reference(W):
    out = spawn_ranks(_worker, W, timeout_s=60, join_timeout_s=180)
    for rank, res in enumerate(out):
        assert res, "no case ran"
        for ci, layout, threads, equal, total, rows in res:
            assert equal, (rank, CASES[ci], layout, threads)
        assert any(total < rows for *_, total, rows in res)  # rows past the plan's total seen


def test_send_compaction_is_token_order_per_destination():
    ids = torch.tensor([[0, 5], [1, 2], [4, 5], [3, 3], [-1, 9]])  # El 2, W 3; -1 / 9 ignored
    rows, n_to = send_host(ids, 2, 3, threads=32)
    assert rows.tolist() == [[0, -1, 0], [1, 0, -1], [-1, -1, 1], [-1, 1, -1], [-1, -1, -1]]
    assert n_to.tolist() == [2, 2, 2]


def test_slot_layout_is_16_byte_aligned_and_disjoint():
    lay = slot_layout(4, 10, 24, 3)
    assert lay["ids_offset"] == 4 * 10 * 48
    assert lay["count_offset"] >= lay["ids_offset"] + 4 * 10 * 3 * 4
    assert all(lay[k] % 16 == 0 for k in ("ids_offset", "count_offset", "slot_bytes"))
    assert lay["slot_bytes"] >= lay["count_offset"] + 16
    with pytest.raises(ValueError):
        slot_layout(2, 4, 12, 2)
