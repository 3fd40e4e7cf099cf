"""Bytes on the wire of the MoE dispatch: one row per (token, k) assignment (`dispatch_to_plan`)
against each token once per destination rank (`MoEDispatch`), counted from model routings.

    PYTHONPATH=$PWD python3 bench/bench_dispatch_bytes.py [--tokens 4096] [--worlds 2,8,16,64]
        [--models deepseek-v3,qwen3-235b-a22b] [--modes balanced,moderate_skew,stress_skew]
        [--seed 0] [--out bench/results]

CPU only, no collective: for each model (`combine.shapes.MODELS`: E, top-k and the hidden size D
the tokens have), world size W and router mode (`moe_overlap.routing`), every rank's routing of
--tokens tokens is drawn (`route(..., rank=r)`) and `dispatch_wire_bytes` counts, per source
rank, the bf16 token bytes that leave it under both schemes and the index bytes of the new one
(top-k ids int32 per sent token, a token count per peer). Same-rank rows are not counted. Rows:
totals over the ranks and the busiest source rank (the one the exchange waits for). JSON with
the result header to --out/dispatch_bytes_<commit>.json; a short table last.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_results import result_header, write_result  # noqa: E402

from moe_overlap.combine import dispatch_wire_bytes  # noqa: E402
from moe_overlap.combine.shapes import MODELS  # noqa: E402
from moe_overlap.routing import ROUTER_MODES, route  # noqa: E402

BF16_BYTES = 2


def measure(model: str, world_size: int, mode: str, tokens: int, seed: int = 0) -> dict:
    """One row: the model's routing on every rank of world_size, counted."""
    E, k, _, D = MODELS[model]
    if E % world_size:
        raise ValueError(f"{model}: {E} experts are not divisible by W={world_size}")
    ids = [route(tokens, E, k, mode, seed=seed, rank=r)[0] for r in range(world_size)]
    per_rank = dispatch_wire_bytes(ids, E // world_size, D, BF16_BYTES)
    total = {f: sum(getattr(w, f) for w in per_rank)
             for f in ("assignments", "tokens", "per_assignment", "once", "once_index",
                       "counts_index")}
    new = [w.once + w.once_index for w in per_rank]
    busiest_old = max(w.per_assignment for w in per_rank)
    n_tokens = tokens * world_size
    return dict(
        model=model, num_experts=E, topk=k, hidden_size=D, world_size=world_size, mode=mode,
        tokens_per_rank=tokens, seed=seed, dtype_bytes=BF16_BYTES,
        off_rank_assignments_per_token=total["assignments"] / n_tokens,
        off_rank_destinations_per_token=total["tokens"] / n_tokens,
        per_assignment_bytes=total["per_assignment"], once_bytes=total["once"],
        once_index_bytes=total["once_index"], counts_index_bytes=total["counts_index"],
        saving=1 - (total["once"] + total["once_index"]) / total["per_assignment"]
        if total["per_assignment"] else 0.0,
        saving_tokens_only=1 - total["once"] / total["per_assignment"]
        if total["per_assignment"] else 0.0,
        busiest_rank_per_assignment_bytes=busiest_old, busiest_rank_once_bytes=max(new),
        busiest_rank_saving=1 - max(new) / busiest_old if busiest_old else 0.0,
        per_rank=[dict(rank=w.rank, assignments=w.assignments, tokens=w.tokens,
                       per_assignment=w.per_assignment, once=w.once, once_index=w.once_index)
                  for w in per_rank])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--worlds", default="2,8,16,64")
    ap.add_argument("--models", default="deepseek-v3,qwen3-235b-a22b")
    ap.add_argument("--modes", default=",".join(ROUTER_MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    rows = [measure(m, int(w), mode, a.tokens, a.seed) for m in a.models.split(",")
            for w in a.worlds.split(",") for mode in a.modes.split(",")]
    doc = dict(result_header("bench_dispatch_bytes", cuda=False), rows=rows,
               what="dispatch bytes leaving each source rank: per (token, k) assignment vs "
                    "once per destination rank (+ int32 top-k ids and token counts); bf16 "
                    "tokens; counted from the routings, same-rank rows excluded")
    path = write_result(doc, a.out, f"dispatch_bytes_{doc['git_commit']}.json")
    print(f"{'model':18s} {'W':>3s} {'mode':14s} {'assign/tok':>10s} {'dest/tok':>8s} "
          f"{'GB today':>9s} {'GB once':>8s} {'saving':>7s} {'busiest':>7s}")
    for r in rows:
        print(f"{r['model']:18s} {r['world_size']:3d} {r['mode']:14s} "
              f"{r['off_rank_assignments_per_token']:10.3f} "
              f"{r['off_rank_destinations_per_token']:8.3f} "
              f"{r['per_assignment_bytes'] / 1e9:9.3f} "
              f"{(r['once_bytes'] + r['once_index_bytes']) / 1e9:8.3f} "
              f"{100 * r['saving']:6.1f}% {100 * r['busiest_rank_saving']:6.1f}%")
    print(path)
    return path


if __name__ == "__main__":
    main()
