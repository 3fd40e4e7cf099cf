"""The producer grouped GEMM as `MoECombine` launches it, on model-shaped plans, against the
library on the same rows unpadded (one GPU; issue 36's measurement).

    PYTHONPATH=$PWD python bench/bench_producer_models.py --out bench/results
    PYTHONPATH=$PWD python bench/bench_producer_models.py --quick --out $OUT
    PYTHONPATH=$PWD python bench/bench_producer_models.py \\
        --variants default,group_by=expert,tile_m=64 --points 'deepseek-v3@4096/*' --out $OUT
    PYTHONPATH=$PWD python bench/bench_producer_models.py --beside consumer \\
        --variants default,cluster_n=2 --worlds 2,8,16 --out $OUT

Points: model (deepseek-v3, qwen3-235b-a22b, qwen3-30b-a3b, mixtral-8x7b:
moe_overlap/combine/shapes.py) x tokens per rank (4096, 16384) x W (1, 2, 8, 16; W must divide
the experts) x routing (balanced; skewed: the mildest router mode of moe_overlap/routing.py whose
busiest expert gets >= 3x the mean load, with a popularity seed that puts that expert on rank 0).
The counts are made for every rank (``routing_counts``: W ranks of `tokens` tokens each) and
rank 0's plan is the one timed: its E / W local experts, its rows from all W ranks' tokens.

Per point and variant, ours is the launch `MoECombine` makes on that plan: the options resolved
by the library (``CombineOptions(...).resolve`` for the layer's facts: ccta, mgb, order, layout;
the tune cache where it holds the bucket, else the analytic choice; at W = 1 that is ccta 0, no
consumer), the plan as ``MoECombine.plan`` makes it, the ``GroupedGemm`` of
``options.producer_gemm_options`` (the dynamic tile fetch; no band flags without a consumer)
launched with the resolved ccta SMs left out of its grid (the consumer's SMs: at W = 1 on one GPU
there is no consumer, so they stay idle, as the combine leaves them to it). Baseline: the faster
of ``torch._grouped_mm`` and a per-expert ``torch.mm`` loop on the valid rows only (compact,
expert-major, unpadded), on every SM. Every path is one CUDA graph, timed in the same
interleaved rounds in a fresh random order per round (``moe_overlap.timing.time_interleaved``,
a GPU sleep ahead of each call). ratio = t_base / t_ours, also scaled by SMs / (SMs - ccta) (the
SMs ours leaves to the consumer).

Correct first, per point, before timing: ours' output (NaN-poisoned beforehand) on the valid rows
within 1e-2 (relative norm) of the per-expert loop and finite, the two baselines within 1e-2 of
each other, every valid band's flag set to the epoch where the launch writes flags (none set
where it does not), the error word clear, and every variant bitwise equal to the first one on
the valid rows. Goals (issue 36), per variant: SM-scaled ratio >= 0.95 on every point and their
geometric mean >= 1.0. The run fails (``failed`` in the JSON, exit status 1) on a wrong output or
where the variant `MoECombine` launches ("default", else the first) misses a goal.
JSON: ``producer_models_<card>_<commit>[_<tag>].json`` in --out.

--beside consumer (default none; issue 36's open question: do clusters of 2 leave part of the
persistent grid without a free SM pair beside a real consumer?): each variant of ccta > 0 is
also launched as ``OverlapCombine._forward_overlap`` launches it, inside one timed CUDA graph:
epoch += 1, the side stream (high priority) waits on the main one, the producer on the main
stream, then the real consumer (``overlap.consumer_for`` the resolved options: its variant,
ccta CTAs, the resolved piece rows) on the side stream, spinning on the band flags and shipping
rank 0's segments, the main stream waits on the side one. One process, no NVSHMEM: the
consumer's peers are loopback copies on this GPU (moe_overlap/combine/loopback.py: a
``CommBuffer`` on a ``LoopbackRuntime``, each of the W ranks' receive slots and communication
block of the size the combine allocates), so every segment lands in local memory (nvlink
transport only; W x one rank's buffer must fit in free memory, else the point is recorded in
``beside_skipped``). Per variant: ``beside_consumer_ms`` (the makespan, timed in the same
rounds as the rest), ``beside_consumer_over_alone`` (/ ``ms``, the producer alone: today's
time, kept), ``beside_consumer_ratio`` (base / it; not SM-scaled: the consumer uses those SMs);
the goals stay on ``ms``. The makespan mixes the producer slowed beside the consumer with the
consumer's tail after it; device stamps separate them (moe_overlap/kernels/stamps.py: a
one-thread kernel storing %globaltimer, in the same graph: before the producer on the main
stream, after it on the main stream, after the consumer on the side stream):
``beside_producer_ms`` (producer end - start, median of the timed replays, p10 / p90),
``beside_producer_over_alone`` (/ ``ms``) and ``beside_consumer_end_ms`` (consumer end -
start). Resolution: the clock's step, about 1 us or finer (``stamp_step_ns``: the gcd of the
point's stamp differences); the stamps are kernels of their own, so the launch gaps between
the start stamp and the producer and between the producer's end and its stamp (a few us
each) count in both. A replay whose stamps are not increasing (an end at or
before the start, a slot never written) makes the variant's stamped times invalid
(``beside_stamps``: valid, bad_rounds, every replay's intervals; ``stamps_valid`` per point),
listed in the summary's ``stamps_invalid``, not summarized. Checked
first, per point: y and every receive slot poisoned, one call, then every shipped row bitwise
y's row, no other receive row written, each copy's counter (call marker + rows) and epoch tag,
the band flags at the epoch, the error word clear, y bitwise the producer's output alone
(``beside_consumer_check``; a failure makes the point wrong). The JSON's ``time_fields`` says
what each time is; ``beside_consumer`` per variant: geomean / max of the over-alone factors
(the makespan's and the producer's own).

Variants (--variants, comma-separated): "default" (the library's options) or key=value pairs
joined by "+": keys of ``CombineOptions`` (ccta, mgb, order, layout, ...) change the options
resolved, tile_m (64 or 128) the layer's band height (plan and GEMM), any other key is a
producer GEMM option (``GroupedGemm``'s keywords, e.g. band_group,
cluster_n; checked by ``CombineOptions.check_gemm_options``). --gemm-option key=value applies
to every variant (as ``CombineOptions(gemm_options=...)``).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import json
import math
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_results import result_header, write_partial, write_result  # noqa: E402
from moe_overlap.combine.options import CombineFacts, CombineOptions  # noqa: E402
from moe_overlap.combine.shapes import MODELS, MODEL_TOKENS  # noqa: E402
from moe_overlap.routing import expert_popularity, routing_counts  # noqa: E402

WORLDS = (1, 2, 8, 16)
ROUTINGS = ("balanced", "skewed")
SKEW_MODES = ("moderate_skew", "stress_skew")  # the mildest that meets MIN_SKEW is used
MIN_SKEW = 3.0  # busiest expert / mean expert load of a skewed routing
GOAL_SCALED = 0.95  # SM-scaled ratio on every point
GOAL_GEOMEAN = 1.0  # geometric mean of the SM-scaled ratios
TOL = 1e-2  # relative norm error against the per-expert loop (bf16 outputs)
TILE_M = 128  # MoECombine's default
TILE_MS = (64, 128)  # the band heights a variant may ask for (tile_m=64: less padding)
LEAD_MS = 2.0  # GPU sleep before each timed call (time_interleaved)
LOOPBACK_HEADROOM = 4 << 30  # free bytes left beside the loopback buffers (graphs, checks)
BESIDE = ("none", "consumer")  # --beside
TIME_FIELDS = {  # what each time of a variant's record is (the JSON's "time_fields")
    "none": {"ms": "the producer alone, ccta SMs left out of its grid and idle"},
    "consumer": {
        "ms": "the producer alone, ccta SMs left out of its grid and idle",
        "beside_consumer_ms": "makespan of one graph replay of the combine's order: epoch += 1, "
                              "producer, the real consumer on the ccta SMs (side stream) "
                              "shipping into loopback peers, with the three stamp kernels "
                              "of beside_producer_ms in it; ccta > 0 only",
        "beside_consumer_over_alone": "beside_consumer_ms / ms",
        "beside_producer_ms": "the producer's own time beside the consumer in the same replays: "
                              "device stamps (%globaltimer, moe_overlap/kernels/stamps.py) of "
                              "the producer's end (a stamp kernel after it on its stream) minus "
                              "the start (a stamp kernel launched just before it); the two "
                              "launch gaps between the stamps and the producer count (a few "
                              "us each); median over the timed replays, p10 / p90; good to "
                              "the clock's step (stamp_step_ns, about 1 us or finer)",
        "beside_producer_over_alone": "beside_producer_ms / ms (ms: CUDA events around a "
                                      "replay of the producer alone)",
        "beside_consumer_end_ms": "the consumer's end (a stamp after it on the side stream) "
                                  "minus the same start: until its last shipment, the "
                                  "producer's time plus the consumer's tail after it"}}
STAMP_START, STAMP_PRODUCER_END, STAMP_CONSUMER_END = range(3)  # slots of a call's stamps
STAMP_SPARE_ROWS = 8  # rows beyond the timed rounds (the check and warm-up calls' stamps)
DEVICE = "cuda"  # (the CPU test of run_point swaps the kernel and the clock for stand-ins)
OPTION_FIELDS = {f.name for f in dataclasses.fields(CombineOptions)} - {"gemm_options"}


# ------------------------------------------------------------------------------ pure parts
def parse_value(text: str):
    """A command-line value: a Python literal (int, float, bool, None) where it parses, else
    the string itself ("expert", "remote_first")."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_pairs(text: str, what: str) -> dict:
    """'k=v+k2=v2' -> {k: v, k2: v2} (values by ``parse_value``)."""
    out = {}
    for item in (p for p in text.split("+") if p):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{what}: {item!r} is not key=value")
        out[key.strip()] = parse_value(val.strip())
    return out


def parse_variants(text: str, gemm_options: dict | None = None) -> list[dict]:
    """[{name, options: CombineOptions keywords, gemm_options}] of --variants: "default" or
    key=value pairs joined by "+" (CombineOptions fields go to the options, other keys to the
    producer GEMM's options); ``gemm_options`` (--gemm-option) under every variant's own."""
    out, names = [], set()
    for name in (v.strip() for v in text.split(",") if v.strip()):
        pairs = {} if name == "default" else parse_pairs(name, "--variants")
        tile_m = pairs.pop("tile_m", TILE_M)  # the layer's (MoECombine's) band height
        if tile_m not in TILE_MS:
            raise ValueError(f"--variants {name!r}: tile_m must be one of {TILE_MS}")
        opts = {k: v for k, v in pairs.items() if k in OPTION_FIELDS}
        gemm = dict(gemm_options or {}, **{k: v for k, v in pairs.items()
                                           if k not in OPTION_FIELDS})
        if name in names:
            raise ValueError(f"--variants: {name!r} given twice")
        names.add(name)
        out.append(dict(name=name, options=opts, gemm_options=gemm, tile_m=tile_m))
    if not out:
        raise ValueError("--variants: none given")
    return out


def variant_options(variant: dict) -> CombineOptions:
    """The variant's requested CombineOptions (validated; its GEMM options checked against the
    GEMM's own keywords, CPU only)."""
    o = CombineOptions(**variant["options"], gemm_options=variant["gemm_options"] or None)
    o.check_gemm_options(variant.get("tile_m", TILE_M))
    return o


def check_beside(options: CombineOptions, beside: str, name: str) -> CombineOptions:
    """ValueError where --beside consumer cannot run the variant: the loopback peers take the
    nvlink consumer only (its stores go through the peer table; nvshmem's through NVSHMEM)."""
    if beside not in BESIDE:
        raise ValueError(f"--beside {beside!r}; choose from {BESIDE}")
    if beside == "consumer" and options.transport != "nvlink":
        raise ValueError(f"--beside consumer: variant {name!r} has transport="
                         f"{options.transport!r}; the loopback peers ship nvlink only")
    return options


def point_label(p: dict) -> str:
    return f"{p['model']}@{p['tokens']}/W{p['world_size']}/{p['routing']}"


def make_points(models=tuple(MODELS), tokens=MODEL_TOKENS, worlds=WORLDS,
                routings=ROUTINGS) -> tuple[list[dict], list[str]]:
    """(points, skipped labels): every model x tokens x W x routing; a W that does not divide
    the model's experts is skipped (mixtral's 8 experts at W = 16)."""
    points, skipped = [], []
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; choose from {sorted(MODELS)}")
        E, topk, K, N = MODELS[m]
        for T in tokens:
            for W in worlds:
                for r in routings:
                    if r not in ROUTINGS:
                        raise ValueError(f"unknown routing {r!r}; choose from {ROUTINGS}")
                    p = dict(model=m, tokens=int(T), world_size=int(W), routing=r, E=E,
                             topk=topk, K=K, N=N)
                    p["label"] = point_label(p)
                    if E % W:
                        skipped.append(p["label"])
                    else:
                        points.append(p)
    return points, skipped


def select_points(points: list[dict], include: str = "", exclude: str = "") -> list[dict]:
    """The points whose label matches one of the comma-separated fnmatch patterns of include
    (all where empty) and none of exclude."""
    inc = [p for p in include.split(",") if p]
    exc = [p for p in exclude.split(",") if p]
    return [p for p in points
            if (not inc or any(fnmatch.fnmatch(p["label"], q) for q in inc))
            and not any(fnmatch.fnmatch(p["label"], q) for q in exc)]


def skew(loads) -> float:
    """Busiest expert's load / the mean load (loads: per expert, any length)."""
    loads = torch.as_tensor(loads, dtype=torch.float64).reshape(-1)
    return float(loads.max() / loads.mean()) if loads.numel() and loads.sum() > 0 else 0.0


def hot_on_rank0_seed(mode: str, E: int, experts_of_rank0: int, first: int = 1) -> int:
    """The first popularity seed >= first whose busiest expert is one of rank 0's (experts
    [0, experts_of_rank0)): the skew then falls on the plan timed, at every W whose rank 0
    holds at least those experts."""
    s = first
    while int(expert_popularity(mode, E, s).argmax()) >= experts_of_rank0:
        s += 1
    return s


def routing_counts_for(model: str, tokens: int, routing: str, world_max: int) -> tuple:
    """(counts [world_max, E] int64, info) of a routing for every rank of the largest world;
    a smaller W's counts are the first W rows (the same seeds per rank). Balanced: seed 1.
    Skewed: the mildest of SKEW_MODES whose busiest expert (over all ranks' tokens) gets
    >= MIN_SKEW x the mean, with ``hot_on_rank0_seed`` for rank 0's experts at world_max."""
    E, topk, _, _ = MODELS[model]
    if routing == "balanced":
        c = routing_counts(world_max, tokens, E, topk, "balanced", 1)
        return c, dict(mode="balanced", seed=1, skew=skew(c.sum(0)))
    c = info = None
    for mode in SKEW_MODES:
        seed = hot_on_rank0_seed(mode, E, E // world_max)
        c = routing_counts(world_max, tokens, E, topk, mode, seed)
        info = dict(mode=mode, seed=seed, skew=skew(c.sum(0)))
        if info["skew"] >= MIN_SKEW:
            break
    return c, info


def scaled_ratio(ratio: float, num_sms: int, ccta: int) -> float:
    """The ratio as if ours had the ccta SMs it leaves to the consumer: ratio x S / (S - ccta)."""
    return ratio * num_sms / (num_sms - ccta)


def evaluate_goals(scaled: dict, min_scaled: float = GOAL_SCALED,
                   min_geomean: float = GOAL_GEOMEAN) -> dict:
    """Goals of one variant from its SM-scaled ratios {label: ratio}: every point >= min_scaled,
    geometric mean >= min_geomean. No point: nothing met."""
    vals = list(scaled.values())
    if not vals:
        return dict(points=0, min_scaled=None, geomean_scaled=None, below=[],
                    every_point=False, geomean=False, met=False)
    gm = math.exp(sum(math.log(v) for v in vals) / len(vals))
    below = sorted(k for k, v in scaled.items() if not v >= min_scaled)
    return dict(points=len(vals), min_scaled=min(vals), geomean_scaled=gm, below=below,
                goal_scaled=min_scaled, goal_geomean=min_geomean, every_point=not below,
                geomean=gm >= min_geomean, met=not below and gm >= min_geomean)


def card_of(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100' (the part's model number), else the name sanitized."""
    m = re.search(r"\b([A-Za-z]\d{2,4}[A-Za-z]?)\b", device_name)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")).lower()


def result_name(device_name: str, commit: str, tag: str = "",
                prefix: str = "producer_models") -> str:
    """<prefix>_<card>_<commit>[_<tag>].json (bench_upproj passes its own prefix)."""
    return f"{prefix}_{card_of(device_name)}_{commit}{'_' + tag if tag else ''}.json"


def ours_variant_name(variants: list[dict]) -> str:
    """The variant MoECombine launches: "default" where timed, else the first."""
    names = [v["name"] for v in variants]
    return "default" if "default" in names else names[0]


def summarize(doc: dict) -> dict:
    """Goals per variant from the points' records, and the run's verdict (also on wrong output)."""
    goals = {}
    for v in doc["variants"]:
        goals[v["name"]] = evaluate_goals({p["label"]: p["variants"][v["name"]]["scaled_ratio"]
                                           for p in doc["points"]
                                           if v["name"] in p.get("variants", {})})
    ours = ours_variant_name(doc["variants"])
    correct = all(p.get("correct", False) for p in doc["points"]) and bool(doc["points"])
    doc.update(goals=goals, ours_variant=ours, all_correct=correct,
               failed=not (correct and goals[ours]["met"]))
    if doc.get("beside") == "consumer":
        doc["beside_consumer"] = {v["name"]: beside_summary(doc["points"], v["name"])
                                  for v in doc["variants"]}
    return doc


def beside_summary(points: list, name: str) -> dict:
    """A variant's times beside the consumer over its time alone, over the points where both
    were timed (geometric mean, max, the worst point): the makespan's
    (``beside_consumer_over_alone``: geomean_over_alone, max_over_alone, worst) and the
    producer's own, stamped (``beside_producer_over_alone``: geomean_producer_over_alone,
    max_producer_over_alone, worst_producer); the labels of the points not timed beside it
    (ccta 0: no consumer; or the loopback did not fit: ``beside_skipped``) and of those whose
    stamps failed their check (stamps_invalid: timed, not summarized)."""
    over, prod, not_timed, invalid = {}, {}, [], []
    for p in points:
        r = p.get("variants", {}).get(name)
        if r is None:
            continue
        if "beside_consumer_over_alone" in r:
            over[p["label"]] = r["beside_consumer_over_alone"]
        else:
            not_timed.append(p["label"])
        if "beside_producer_over_alone" in r:
            prod[p["label"]] = r["beside_producer_over_alone"]
        elif "beside_stamps" in r:
            invalid.append(p["label"])

    def geomean(d):
        return math.exp(sum(math.log(v) for v in d.values()) / len(d)) if d else None
    return dict(points=len(over), not_timed=not_timed, geomean_over_alone=geomean(over),
                max_over_alone=max(over.values()) if over else None,
                worst=max(over, key=over.get) if over else None,
                producer_points=len(prod), stamps_invalid=invalid,
                geomean_producer_over_alone=geomean(prod),
                max_producer_over_alone=max(prod.values()) if prod else None,
                worst_producer=max(prod, key=prod.get) if prod else None)


def quantiles_ms(times: list) -> dict:
    """median, p10, p90 of a list of ms, as ``timing.time_interleaved`` takes them."""
    import statistics
    ts = sorted(times)

    def q(f):
        return ts[min(len(ts) - 1, int(f * len(ts)))]
    return dict(median_ms=statistics.median(ts), p10_ms=q(0.1), p90_ms=q(0.9))


def stamp_intervals(rows) -> dict:
    """The timed replays' stamps (int64 [rounds, 3]: start, producer end, consumer end per
    replay, round order) as intervals in ms: producer_ms (producer end - start),
    consumer_end_ms (consumer end - start). Checked: every stamp set and both ends after the
    start; a replay where not is listed in bad_rounds and makes the whole record invalid
    (its intervals are still given, for a look, never summarized)."""
    producer, consumer_end, bad = [], [], []
    for i, (s, p, c) in enumerate(rows.tolist()):
        if not (s > 0 and p > s and c > s):
            bad.append(i)
        producer.append((p - s) / 1e6)
        consumer_end.append((c - s) / 1e6)
    return dict(valid=not bad and bool(producer), bad_rounds=bad, producer_ms=producer,
                consumer_end_ms=consumer_end)


def add_stamped_times(r: dict, st: dict) -> dict:
    """A variant's record r (its ``ms`` set) with ``beside_stamps`` = st and, where st is valid,
    beside_producer_ms / _p10_ms / _p90_ms, beside_producer_over_alone and
    beside_consumer_end_ms / _p10_ms / _p90_ms."""
    r["beside_stamps"] = st
    if st["valid"]:
        for field, key in (("beside_producer", "producer_ms"),
                           ("beside_consumer_end", "consumer_end_ms")):
            q = quantiles_ms(st[key])
            r[field + "_ms"], r[field + "_p10_ms"], r[field + "_p90_ms"] = (
                q["median_ms"], q["p10_ms"], q["p90_ms"])
        r["beside_producer_over_alone"] = r["beside_producer_ms"] / r["ms"]
    return r


# ------------------------------------------------------------------------------ the GPU part
def resolve(point: dict, variant: dict, num_sms: int, device_name: str, cache):
    """(requested, resolved CombineOptions, tuned?, tile_m) of the layer MoECombine builds for
    the point (rank 0 of a world of W; rows: tokens x topk at full load)."""
    E, topk, K, N, W = (point[k] for k in ("E", "topk", "K", "N", "world_size"))
    tile_m = variant.get("tile_m", TILE_M)
    facts = CombineFacts(world_size=W, hidden_size=K, out_features=N, experts_per_rank=E // W,
                         tile_m=tile_m, rows=point["tokens"] * topk, device_name=device_name,
                         num_sms=num_sms)
    req = variant_options(variant)
    return (req, req.resolve(facts, cache=cache), cache.entry(req.tune_key(facts)) is not None,
            tile_m)


def _rel(a, b, rows: int = 8192) -> float:
    """||a - b|| / ||b|| in fp32, a block of rows at a time: the fp32 copies of a whole output
    (250k rows of 7168 at deepseek-v3 W = 16) do not fit beside the point's buffers."""
    diff = ref = 0.0
    for i in range(0, b.shape[0], rows):
        d, r = a[i:i + rows].float() - b[i:i + rows].float(), b[i:i + rows].float()
        diff, ref = diff + float((d * d).sum()), ref + float((r * r).sum())
    return (diff / max(ref, 1e-60)) ** 0.5


def side_stream(dev):
    """The consumer's stream beside the producer (high priority, as ``OverlapCombine.cs``)."""
    return torch.cuda.Stream(device=dev, priority=-1)


def free_device_bytes(dev) -> int | None:
    """Free memory of the device (None off CUDA: not checked)."""
    return torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None


def loopback_layers(point: dict, resolved: dict) -> dict:
    """{variant name: LayerShape} of the variants a consumer runs beside (ccta > 0): the
    communication size ``OverlapCombine`` attaches for the point's layer (T x topk rows of N;
    with scale="ordered" its per-segment arrival words)."""
    from moe_overlap.combine.comm_buffer import LayerShape
    return {name: LayerShape(point["tokens"], point["topk"], point["N"],
                             experts=point["E"] if opts.scale == "ordered" else 0,
                             tile_m=tile_m)
            for name, (_, opts, _, tile_m) in resolved.items() if opts.ccta > 0}


def loopback_bytes(layers, world_size: int) -> int:
    """Device bytes of the loopback buffer for these layers: W copies of what one rank's shared
    CommBuffer holds (``heap_report``'s shared bytes: the combine's own sizing)."""
    from moe_overlap.combine.comm_buffer import heap_report
    return world_size * heap_report(list(layers), world_size)["shared_bytes"]


def run_point(point: dict, counts: torch.Tensor, resolved: dict, rounds: int, seed: int,
              beside: str = "none"):
    """One point: every variant's launch and both baselines checked, then timed in the same
    interleaved rounds. resolved: {variant name: (requested, resolved options, tuned, tile_m)}.
    beside="consumer": each variant with ccta > 0 is also launched and timed with the real
    consumer beside it (``beside_consumer``), checked first (``check_loopback``)."""
    from moe_overlap.combine.baseline import plan_to_compact_rows
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    from moe_overlap.combine.options import producer_gemm_options, producer_tile_n
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.kernels.errors import describe_error
    from moe_overlap.kernels.stamps import timer_step_ns
    from moe_overlap import timing
    E, topk, K, N, W, T = (point[k] for k in ("E", "topk", "K", "N", "world_size", "tokens"))
    El, dev = E // W, torch.device(DEVICE)
    S = torch.cuda.get_device_properties(dev).multi_processor_count
    counts = counts[:W].to(dev)
    rows_e = counts[:, :El].sum(0)  # rank 0's experts: rows from every rank
    n_valid = int(rows_e.sum())
    g = torch.Generator(device=dev).manual_seed(seed)
    x_c = torch.randn(n_valid, K, device=dev, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(El, K, N, device=dev, generator=g, dtype=torch.bfloat16) * K ** -0.5)
    offs = torch.cumsum(rows_e, 0).to(torch.int32)
    starts = [0] + torch.cumsum(rows_e, 0).tolist()
    rec = dict(point, valid_rows=n_valid, gflop=2.0 * n_valid * K * N / 1e9, num_sms=S,
               rank0_skew=skew(rows_e.cpu()) if El > 1 else None,
               global_skew=skew(counts.sum(0).cpu()), variants={})
    y_gm, y_loop = {}, torch.empty(n_valid, N, device=dev, dtype=torch.bfloat16)

    def grouped_mm():
        y_gm["y"] = torch._grouped_mm(x_c, w, offs=offs)

    def loop():
        for e in range(El):
            a, b = starts[e], starts[e + 1]
            if b > a:
                torch.mm(x_c[a:b], w[e], out=y_loop[a:b])
    fns = {"base:grouped_mm": grouped_mm, "base:mm_loop": loop}
    epoch = torch.ones(1, dtype=torch.int32, device=dev)
    ours = {}
    for name, (req, opts, tuned, tile_m) in resolved.items():
        plan = plan_combine(counts, 0, tile_m=tile_m, mgb=opts.mgb, max_rows=W * T * topk,
                            validate=False, layout=opts.layout, order=opts.order)
        rows = int(plan.total_rows.item())
        idx = plan_to_compact_rows(plan, counts)  # plan row of each compact row
        x = torch.zeros(max(rows, 1), K, device=dev, dtype=torch.bfloat16)
        x[idx] = x_c
        y = torch.empty(max(rows, 1), N, device=dev, dtype=torch.bfloat16)
        kw = producer_gemm_options(opts.gemm_options, opts.ccta)
        gemm = GroupedGemm(tile_m=tile_m, tile_n=producer_tile_n(N), **kw)
        ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=dev)
        err = torch.zeros(8, dtype=torch.int64, device=dev)
        fns[name] = (lambda gemm=gemm, x=x, y=y, p=plan, ready=ready, err=err, c=opts.ccta:
                     gemm(x, w, y, p.band_expert, p.band_src_row, p.schedule, p.num_bands, ready,
                          epoch, ccta=c, err=err,
                          band_valid=p.band_valid if gemm.skip_padding else None))
        nb = int(plan.num_bands.item())
        cluster = gemm.cluster_for(N)
        grid = gemm.grid_size(S, opts.ccta, N)
        ours[name] = dict(y=y, idx=idx, ready=ready, err=err, plan=plan, signal=gemm.signal,
                          gemm=gemm, x=x, opts=opts, tile_m=tile_m)
        rec["variants"][name] = dict(
            requested=dict({f.name: getattr(req, f.name) for f in dataclasses.fields(req)},
                           gemm_options=dict(req.gemm_options)),
            ccta=opts.ccta, mgb=opts.mgb, order=opts.order, layout=opts.layout, tuned=tuned,
            plan_layout=plan.layout, plan_packed=bool(plan.packed.item()), plan_rows=rows,
            padding=rows / max(n_valid, 1), bands=nb, grid=grid,
            gemm=dict(tile_m=tile_m, tile_n=gemm.tile_n, cluster_n=cluster,
                      band_group=gemm.band_group, signal=gemm.signal, **{
                          k: v for k, v in kw.items() if k not in ("cluster_n", "signal",
                                                                    "band_group")}))
    # ---- correctness: poisoned outputs, one call each -----------------------------------
    for o in ours.values():
        o["y"].fill_(float("nan"))
    y_loop.fill_(float("nan"))
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    ok = True
    rec["base_err_grouped_mm_vs_loop"] = _rel(y_gm["y"], y_loop)
    ok &= rec["base_err_grouped_mm_vs_loop"] <= TOL
    first = None
    for name, o in ours.items():
        r = rec["variants"][name]
        got = o["y"][o["idx"]]
        r["finite"] = bool(torch.isfinite(got).all())
        r["err_vs_loop"] = _rel(got, y_loop)
        p, nb = o["plan"], r["bands"]
        valid = torch.zeros(p.band_capacity, dtype=torch.bool, device=dev)
        valid[p.schedule[:nb].long()] = True
        want = torch.where(valid, epoch, torch.zeros_like(epoch)) if o["signal"] else 0
        r["flags_ok"] = bool((o["ready"] == want).all())
        r["error_word"] = describe_error(o["err"].tolist()) or ""
        o["alone_rows"] = got if beside == "consumer" else None  # (a copy: y[idx])
        if first is None:
            first = got
        r["bitwise_vs_first_variant"] = bool(torch.equal(got.view(torch.int16),
                                                         first.view(torch.int16)))
        r["correct"] = (r["finite"] and r["err_vs_loop"] <= TOL and r["flags_ok"]
                        and not r["error_word"] and r["bitwise_vs_first_variant"])
        ok &= r["correct"]
    # ---- the real consumer beside the producer (--beside consumer): set up and checked ---
    rec["beside"] = beside
    if beside == "consumer":
        for name, fn in beside_consumer(point, ours, w, rec, dev, rounds).items():
            fns[name + BESIDE_KEY] = fn
            r = rec["variants"][name]
            r["bitwise_beside_vs_alone"] = bool(torch.equal(
                ours[name]["y"][ours[name]["idx"]].view(torch.int16),
                ours[name]["alone_rows"].view(torch.int16)))
            r["correct"] = (r["correct"] and r["beside_consumer_check"]["ok"]
                            and r["bitwise_beside_vs_alone"])
            ok &= r["correct"]
    rec["correct"] = bool(ok)
    # ---- timing: CUDA graphs, interleaved rounds in a random order ----------------------
    graphs = {k: timing.graphed(f) for k, f in fns.items()}
    t = timing.time_interleaved({k: gr.replay for k, gr in graphs.items()}, rounds=rounds,
                         lead_ms=LEAD_MS, shuffle_seed=seed)
    for k in ("base:grouped_mm", "base:mm_loop"):
        rec[k.replace("base:", "base_") + "_ms"] = t[k]["median_ms"]
    best = min(("base:grouped_mm", "base:mm_loop"), key=lambda k: t[k]["median_ms"])
    rec["base"], rec["base_ms"] = best.replace("base:", ""), t[best]["median_ms"]
    steps = []
    for name in ours:
        r = rec["variants"][name]
        r["ms"], r["p10_ms"], r["p90_ms"] = (t[name][q] for q in ("median_ms", "p10_ms",
                                                                   "p90_ms"))
        r["tflops"] = rec["gflop"] / r["ms"]
        r["ratio"] = rec["base_ms"] / r["ms"]
        r["scaled_ratio"] = scaled_ratio(r["ratio"], S, r["ccta"])
        r["ratio_paired"] = sorted(a / b for a, b in zip(t[best]["times"], t[name]["times"])
                                   )[rounds // 2]
        b = name + BESIDE_KEY
        if b in t:  # the makespan of producer + consumer (one graph replay)
            r["beside_consumer_ms"], r["beside_consumer_p10_ms"], r["beside_consumer_p90_ms"] = (
                t[b][q] for q in ("median_ms", "p10_ms", "p90_ms"))
            r["beside_consumer_ratio"] = rec["base_ms"] / r["beside_consumer_ms"]
            r["beside_consumer_over_alone"] = r["beside_consumer_ms"] / r["ms"]
            # the same replays' device stamps: the last `rounds` calls are the timed ones
            # (time_interleaved's warm-up calls come first), in round order as t[b]["times"]
            rows = ours[name]["beside"]["stamps"].last_calls(rounds)
            add_stamped_times(r, stamp_intervals(rows))
            steps.append(rows)
    if steps:  # the clock's step seen in this point's stamps, and their check
        rec["stamp_step_ns"] = timer_step_ns(int(v) for x in steps for v in x.reshape(-1))
        rec["stamps_valid"] = all(r["beside_stamps"]["valid"] for r in rec["variants"].values()
                                  if "beside_stamps" in r)
    return rec


BESIDE_KEY = "|beside_consumer"  # timing key suffix of a variant's launch beside the consumer


def beside_consumer(point: dict, ours: dict, w, rec: dict, dev, rounds: int) -> dict:
    """The combine's launch order, with the real consumer, for every variant of ccta > 0:
    {variant name: fn}. One loopback communication buffer (moe_overlap/combine/loopback.py:
    one copy of rank 0's buffers per rank of W on this GPU, sized by the combine's
    CommBuffer) serves them all, as one CommBuffer serves the layers of a model; each fn is
    OverlapCombine._forward_overlap's producer and consumer part: epoch += 1 (begin_call), the
    start stamp, the side stream waits on the main one, the producer (the variant's
    GroupedGemm, the buffer's epoch and error word), the consumer (``consumer_for`` the
    resolved options, ccta CTAs, the resolved piece rows) then the consumer-end stamp on the
    side stream, the producer-end stamp on the main stream, the main stream waits on the side
    one. The stamps (``DeviceStamps`` of rounds + STAMP_SPARE_ROWS calls, one per variant, in
    ours[name]["beside"]["stamps"]) come before the fork and after each part, so the side
    stream's stamp reads the call count the start stamp advanced. Before timing,
    each is run once alone (modules loaded) and once checked: y and the receive slots
    poisoned, one call, then ``check_loopback`` (every shipped row bitwise y's, nothing else
    written, counters, tags, error word) and the band flags at the epoch; into
    rec["variants"][name]["beside_consumer_check"]. A point whose loopback does not fit in
    free memory is recorded in rec["beside_skipped"] (no fn)."""
    from moe_overlap.combine.comm_buffer import ordered_segment_capacity
    from moe_overlap.combine.loopback import (attach_layer, check_loopback, loopback_comm_buffer,
                                              loopback_copies, poison_slots)
    from moe_overlap.combine.overlap import consumer_for
    from moe_overlap.kernels.stamps import DeviceStamps
    W, T, topk, N, E = (point[k] for k in ("world_size", "tokens", "topk", "N", "E"))
    layers = loopback_layers(point, {n: (None, o["opts"], None, o["tile_m"])
                                     for n, o in ours.items()})
    if not layers:
        return {}
    for name in layers:
        if ours[name]["opts"].transport != "nvlink":
            raise ValueError(f"--beside consumer: variant {name!r} resolves transport="
                             f"{ours[name]['opts'].transport!r}; the loopback ships nvlink only")
    need, free = loopback_bytes(layers.values(), W), free_device_bytes(dev)
    rec["beside_loopback_bytes"] = need
    if free is not None and need + LOOPBACK_HEADROOM > free:
        rec["beside_skipped"] = (f"the loopback buffers need {need / 2**30:.1f} GiB, "
                                 f"{free / 2**30:.1f} GiB free")
        return {}
    buf = loopback_comm_buffer(W, dev)
    cs = side_stream(dev)
    DeviceStamps.warmup(dev)  # its module loaded before any consumer spins
    fns = {}
    for name in layers:
        o = ours[name]
        opts, p, gemm, x, y = o["opts"], o["plan"], o["gemm"], o["x"], o["y"]
        ordered = opts.scale == "ordered"
        seg_cap = ordered_segment_capacity(W, T, topk, E // W, o["tile_m"]) if ordered else 0
        if ordered and p.segment_capacity != seg_cap:  # the arrival words' row stride
            raise ValueError(f"{name}: plan segment capacity {p.segment_capacity} != the "
                             f"layer's {seg_cap} (plans of MoECombine.plan's max_rows)")
        ready = torch.zeros(p.band_capacity, dtype=torch.int32, device=dev)
        o["attached"] = attach_layer(buf, T * topk, N * 2, W * seg_cap, band_ready=ready)
        consumer = consumer_for(opts)
        stamps = DeviceStamps(rounds + STAMP_SPARE_ROWS, 3, dev)

        def produce(gemm=gemm, x=x, y=y, p=p, ready=ready, c=opts.ccta):
            gemm(x, w, y, p.band_expert, p.band_src_row, p.schedule, p.num_bands, ready,
                 buf.epoch, ccta=c, err=buf.err,
                 band_valid=p.band_valid if gemm.skip_padding else None)

        def ship(consumer=consumer, y=y, p=p, ready=ready, c=opts.ccta,
                 pr=opts.consumer_piece_rows):
            b = buf.buffers
            consumer.launch(y=y, plan=p, band_ready=ready, epoch=buf.epoch,
                            recv_peers=b.recv_peers, ctr_peers=b.ctr_peers,
                            recv_sym=b.recv.data_ptr(), ctr_sym=b.counters.data_ptr(),
                            err=buf.err, ccta=c, slot_bytes=buf.slot_bytes, piece_rows=pr,
                            stream=cs)

        def call(produce=produce, ship=ship, stamps=stamps):
            s0 = torch.cuda.current_stream(dev)
            buf.epoch.add_(1)  # begin_call: a new epoch, so last call's flags do not match
            stamps.stamp(STAMP_START, first=True, stream=s0)
            cs.wait_stream(s0)  # on begin_call, not on the producer (launched first)
            produce()
            with torch.cuda.stream(cs):
                ship()
                stamps.stamp(STAMP_CONSUMER_END, stream=cs)
            stamps.stamp(STAMP_PRODUCER_END, stream=s0)  # after the consumer's launch (eager)
            s0.wait_stream(cs)
        fns[name] = call
        o["beside"] = dict(produce=produce, ship=ship, seg_cap=seg_cap, stamps=stamps,
                           arrival="segment" if ordered else "counter")
    for name, call in fns.items():
        o, r = ours[name], rec["variants"][name]
        # alone first: the producer, then the consumer finding every flag set (loads its
        # module while nothing spins, as OverlapCombine's warm-up)
        buf.epoch.add_(1)
        o["beside"]["produce"]()
        torch.cuda.synchronize()
        o["beside"]["ship"]()
        torch.cuda.synchronize()
        o["y"].fill_(float("nan"))
        poison_slots(buf)
        blocks = [b.clone() for b in loopback_copies(buf)["block"]]
        call()
        torch.cuda.synchronize()
        epoch = int(buf.epoch.item())
        chk = check_loopback(o["plan"], o["y"], buf, blocks, epoch, o["opts"].local_copy,
                             o["beside"]["arrival"], o["beside"]["seg_cap"])
        p, nb = o["plan"], r["bands"]
        valid = torch.zeros(p.band_capacity, dtype=torch.bool, device=dev)
        valid[p.schedule[:nb].long()] = True
        chk["flags_ok"] = bool((o["attached"].band_ready[valid] == epoch).all())
        chk["ok"] = chk["ok"] and chk["flags_ok"]
        opts = o["opts"]
        chk.update(epoch=epoch, consumer=dict(
            ccta=opts.ccta, piece_rows=opts.consumer_piece_rows, copy=opts.copy,
            local_copy=opts.local_copy, scale=opts.scale, threads=opts.consumer_threads,
            stages=opts.consumer_stages, chunk=opts.consumer_chunk))
        r["beside_consumer_check"] = chk
    rec["beside_loopback"] = dict(world_size=W, slot_bytes=buf.slot_bytes,
                                  block_words=int(buf.buffers.block.numel()))
    return fns


def stamped_text(r: dict) -> str:
    """The printed part of a variant's stamped times beside the consumer ("" if none)."""
    if "beside_stamps" not in r:
        return ""
    if not r["beside_stamps"]["valid"]:
        return f"; stamps INVALID (rounds {r['beside_stamps']['bad_rounds']})"
    return (f"; producer itself {r['beside_producer_ms']:.3f} ms "
            f"({r['beside_producer_over_alone']:.3f}x alone), consumer end "
            f"{r['beside_consumer_end_ms']:.3f} ms")


def add_point_arguments(ap):
    """The point selection and timing arguments this bench shares with bench_upproj.py."""
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, MODEL_TOKENS)),
                    help="tokens per rank")
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)),
                    help="world sizes W of rank 0's plans")
    ap.add_argument("--routings", default=",".join(ROUTINGS))
    ap.add_argument("--points", default="", help="fnmatch patterns of point labels to run "
                    "(model@tokens/W<w>/routing, e.g. 'deepseek-v3@*/W2/*'); all where empty")
    ap.add_argument("--skip-points", default="", help="fnmatch patterns of labels to skip")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per point")
    ap.add_argument("--quick", action="store_true",
                    help="4096 tokens, W = 1 and 8, skewed routings, 5 rounds (a smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the JSON name (split runs)")


def parse_point_arguments(ap, argv):
    """ap.parse_args(argv) with --quick applied and --rounds checked."""
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.worlds, a.routings, a.rounds = "4096", "1,8", "skewed", min(a.rounds, 5)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    return a


def merge_runs(docs: list, names: list) -> dict:
    """One document from runs of one card and commit with the same variants (a grid split over
    processes, e.g. one model each): their points in order, the routings, each run's name and,
    for a run cut short (a ``.partial``), how many of its points it finished; then summarized
    as one run."""
    keys = {(d["device"], d["git_commit"], tuple(v["name"] for v in d["variants"]),
             d.get("beside"), d["rounds"]) for d in docs}
    if len(keys) != 1:
        raise ValueError(f"runs differ in card, commit, variants, beside or rounds: {sorted(keys)}")
    out = dict(docs[0], points=[], routings={}, date=max(d["date"] for d in docs),
               merged_from=[], skipped_points=[s for d in docs for s in d["skipped_points"]])
    out.pop("partial", None)
    labels = set()
    for d, name in zip(docs, names):
        for p in d["points"]:
            if p["label"] in labels:
                raise ValueError(f"point {p['label']} is in two runs")
            labels.add(p["label"])
        out["points"] += d["points"]
        out["routings"].update(d["routings"])
        out["merged_from"].append(dict(name=name, points=len(d["points"]),
                                       **({"partial": d["partial"]} if "partial" in d else {})))
    return summarize(out)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_point_arguments(ap)
    ap.add_argument("--variants", default="default",
                    help="comma-separated: default, or key=value[+key=value] (module doc)")
    ap.add_argument("--gemm-option", action="append", default=[], metavar="KEY=VALUE",
                    help="producer GEMM option for every variant (repeatable)")
    ap.add_argument("--beside", choices=BESIDE, default="none",
                    help="consumer: also time each variant of ccta > 0 with the real consumer "
                    "beside it, into loopback peers (module doc)")
    a = parse_point_arguments(ap, argv)
    if a.beside == "consumer":
        # a spinning kernel next to a lazily loaded module can stall (OverlapCombine's warning)
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    try:
        gemm_opts = {}
        for kv in a.gemm_option:
            gemm_opts.update(parse_pairs(kv, "--gemm-option"))
        variants = parse_variants(a.variants, gemm_opts)
        for v in variants:
            check_beside(variant_options(v), a.beside, v["name"])  # before any GPU work
        points, skipped = make_points(
            [m for m in a.models.split(",") if m], [int(t) for t in a.tokens.split(",")],
            [int(w) for w in a.worlds.split(",")], [r for r in a.routings.split(",") if r])
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    points = select_points(points, a.points, a.skip_points)
    if not points:
        ap.error("no point selected")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from moe_overlap.combine.tuning import TuneCache
    dev_name = torch.cuda.get_device_name()
    S = torch.cuda.get_device_properties(0).multi_processor_count
    cache = TuneCache()
    doc = dict(result_header("producer_models"), card=card_of(dev_name), gpus=1, num_sms=S,
               tune_cache=cache.path, rounds=a.rounds, lead_ms=LEAD_MS, tol=TOL,
               beside=a.beside, time_fields=TIME_FIELDS[a.beside],
               variants=variants, skipped_points=skipped, routings={}, points=[],
               method="ours: GroupedGemm with the options CombineOptions.resolve gives the "
                      "layer (producer_gemm_options), ccta SMs left out of its grid; base: the "
                      "faster of torch._grouped_mm and a per-expert torch.mm loop on the valid "
                      "rows, every SM; CUDA graphs, time_interleaved (shuffled rounds, GPU "
                      "sleep of lead_ms ahead of each call), medians; ratio = base / ours, "
                      "scaled by SMs / (SMs - ccta)")
    # every point's options resolved up front (a bad option fails before any timing)
    resolved = {p["label"]: {v["name"]: resolve(p, v, S, dev_name, cache) for v in variants}
                for p in points}
    worlds = [int(w) for w in a.worlds.split(",")]
    print(f"{dev_name} ({S} SMs): {len(points)} points x {len(variants)} variant(s) "
          f"({', '.join(v['name'] for v in variants)}), {a.rounds} rounds; skipped "
          f"{len(skipped)} (W not dividing the experts)", flush=True)
    t0 = time.time()
    counts_cache = {}
    result_file = result_name(dev_name, doc["git_commit"], a.tag)
    for i, p in enumerate(points):
        key = (p["model"], p["tokens"], p["routing"])
        if key not in counts_cache:
            # the largest W of --worlds (not of the selected points): the same routing
            # whatever --points picks
            w_max = max(w for w in worlds if p["E"] % w == 0)
            counts_cache[key] = routing_counts_for(p["model"], p["tokens"], p["routing"], w_max)
            doc["routings"]["{}@{}/{}".format(*key)] = dict(counts_cache[key][1], ranks=w_max)
        counts, info = counts_cache[key]
        rec = run_point(p, counts, resolved[p["label"]], a.rounds, a.seed + i, a.beside)
        torch.cuda.empty_cache()  # the point's tensors and graphs went with run_point's frame
        rec["routing_mode"], rec["routing_seed"] = info["mode"], info["seed"]
        doc["points"].append(rec)
        vs = " ".join(f"{n}: ccta {r['ccta']} {r['ms']:.3f} ms {r['ratio']:.3f}x "
                      f"({r['scaled_ratio']:.3f}x scaled)"
                      + (f", beside the consumer {r['beside_consumer_ms']:.3f} ms "
                         f"({r['beside_consumer_over_alone']:.3f}x alone)"
                         if "beside_consumer_ms" in r else "") + stamped_text(r)
                      for n, r in rec["variants"].items())
        if rec.get("beside_skipped"):
            vs += f" | beside: skipped ({rec['beside_skipped']})"
        el = time.time() - t0
        print(f"[{i + 1}/{len(points)} {el:5.0f} s, ~{el / (i + 1) * (len(points) - i - 1):.0f} "
              f"s left] {p['label']:<36} rows {rec['valid_rows']:>6} base {rec['base']} "
              f"{rec['base_ms']:.3f} ms | {vs} | correct {rec['correct']}", flush=True)
        write_partial(doc, a.out, result_file, i + 1, len(points))
    summarize(doc)
    path = write_result(doc, a.out, result_file)
    for name, bs in doc.get("beside_consumer", {}).items():
        if bs["points"]:
            print(f"{name} beside the consumer: {bs['geomean_over_alone']:.3f}x its time alone "
                  f"(geomean of {bs['points']} points; max {bs['max_over_alone']:.3f}x at "
                  f"{bs['worst']}); not timed beside: {len(bs['not_timed'])}")
        if bs["producer_points"]:
            print(f"{name}'s producer itself beside the consumer (stamped): "
                  f"{bs['geomean_producer_over_alone']:.3f}x alone (geomean of "
                  f"{bs['producer_points']} points; max {bs['max_producer_over_alone']:.3f}x "
                  f"at {bs['worst_producer']})")
        if bs["stamps_invalid"]:
            print(f"{name}: stamps failed their check (timing invalid) at "
                  f"{', '.join(bs['stamps_invalid'])}")
    for name, gl in doc["goals"].items():
        print(f"{name}: SM-scaled min {gl['min_scaled']:.3f} (goal {GOAL_SCALED}, below on "
              f"{len(gl['below'])}), geomean {gl['geomean_scaled']:.3f} (goal {GOAL_GEOMEAN}): "
              f"{'met' if gl['met'] else 'MISSED'}")
    print(f"wrote {path}; all correct: {doc['all_correct']}; "
          f"{'FAILED' if doc['failed'] else 'passed'} ({doc['ours_variant']})")
    return 1 if doc["failed"] else 0


def merge_main(argv) -> int:
    """``bench_producer_models.py merge RUN.json [RUN.json.partial ...] --out FILE``."""
    ap = argparse.ArgumentParser(prog="bench_producer_models.py merge",
                                 description=merge_runs.__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="result files (.json, or .partial of a cut run)")
    ap.add_argument("--out", required=True, help="the merged file")
    a = ap.parse_args(argv)
    try:
        doc = merge_runs([json.load(open(r)) for r in a.runs],
                         [os.path.basename(r) for r in a.runs])
    except ValueError as e:
        ap.error(str(e))
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    g = doc["goals"][doc["ours_variant"]]
    print(f"{a.out}: {len(doc['points'])} points, {doc['ours_variant']}: SM-scaled min "
          f"{g['min_scaled']:.3f}, geomean {g['geomean_scaled']:.3f}; all correct "
          f"{doc['all_correct']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
