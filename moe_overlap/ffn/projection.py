"""Projection of the tensor-parallel FFN to G = 2, 4, 8 GPUs of one NVLink node from measured rates.

The machines here stop at 2 GPUs (and the chained layer has no 2-GPU run yet), so larger G is
projected, not measured. Per GPU of G, for T tokens and a shape (P, O, N), O/G the hidden slice:

    flops      = 2 T (O/G) (P + N)                                   (shrinks with G)
    bus        = 2 (G - 1) / G                                       (ring / reduce-scatter +
                                                                      all-gather bus factor)
    reference  = flops / R_torch  +  bus * T N 2 B / busbw_nccl(G)   (all-reduce bytes do not
                                                                      shrink with G)
    fused      = max(t_comp + t_tail, t_ar + t_band)
      t_comp   = flops / (R_torch * rel_path) * S / (S - ccta)       (compute on SMs - ccta)
      t_ar     = bus * T N b / ar_bw(ccta)    ar_bw(c) = min(c * r_sm, cap_ratio * busbw_nccl(G))
      t_tail   = the rows whose band flags the last compute wave raises (ceil(grid / tiles per
                 row block) row blocks), all-reduced after the compute ends
      t_band   = one band, all-reduced after the all-reduce has caught up with the compute

- R_torch: torch addmm + act + mm on one H200 at the G = 2 hidden slice, per shape and token count
  (`ffn_baseline_h200.json`), held at that rate for the smaller slices of G = 4 / 8 (an
  assumption: optimistic where the slice gets short, flagged where it falls below the smallest
  slice measured, 1024).
- rel_path: the fused compute kernel's rate relative to torch's, measured on all SMs of one GPU:
  "chained" (`ffn_chained_compute_h200_auto_phased_918b75d.json`: the sustained ratio, each path
  alone back to back at the power cap, per shape and token count; the interleaved ratio favours
  the path drawing more power, bench/NOTES.md, session 15; the order group="auto" runs,
  phased where one fits: session 17), "reduce" (the seed's kernel,
  compute="reduce": `fused_compute` against `compute`
  in the same run of `ffn_fused_v7_final_2xh200.json`, T = 8192 only, used for every T).
- b: bytes per element of the band all-reduce: 4 for "reduce" (fp32 partials), 2 for "chained"
  (bf16 partial bands, as the issue designs them; built, not yet timed on two GPUs: its per-SM
  rate is assumed equal to the fp32 band all-reduce's in bus bytes per second).
- r_sm: the band all-reduce's bus bytes per second per SM, the median of its 16-SM runs alone
  (`fused_ar_layer_sms` in the v7 file); cap_ratio: the band all-reduce on every SM against NCCL
  on the same fp32 bytes (`band_ar` / `nccl_fp32`, median over shapes), applied to NCCL's bus
  bandwidth at G.
- busbw_nccl(G): NCCL's bf16 all-reduce bus bandwidth, measured per shape at G = 2 (T = 8192, v7
  file); for G = 4 and 8 **assumed** (default: the same per-shape 2-GPU value; `--busbw-gbps`
  sets one value for G > 2), and for T = 32768 the 8192-token value.
- ccta: the best of `CCTA_CHOICES` per point (the model's choice, not a tuned value).

`check_reduce` replays the model of the compute="reduce" path on the measured 2-GPU layer (its
own ccta) and reports its error per shape. The chained path has no 2-GPU measurement: its rows
are model only. `layer_speedup` is the part `FusedFFN(backend="auto")` uses.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field

from .options import fused_default_allreduce_band_rows, fused_default_ccta, fused_tile_o
from .shapes import FFN_SHAPES
from ..provenance import Git, result_source, source_text

PATHS = ("chained", "reduce")
CCTA_CHOICES = (4, 8, 12, 16, 20, 24, 32, 40, 48, 64)
TOKENS = (8192, 32768)
WORLDS = (2, 4, 8)
SEED_CLAIM = ("the seed's fused FFN: 1.3-2.6x over the plain baseline at G = 8 (quoted by the "
              "issue's brief; not stated in README, docs or bench/NOTES.md)")
MIN_MEASURED_SLICE = 1024  # the narrowest hidden slice R_torch / rel_path were measured at

# the files every rate below comes from (bench/results/)
SOURCES = {
    "torch_tflops": "ffn_baseline_h200.json (rows[].tflops: addmm + act + mm, G = 2 slices)",
    "chained_rel": "ffn_chained_compute_h200_auto_phased_918b75d.json (rows[].hold_speedup: "
                   "chained kernel / torch, each held alone back to back, all 132 SMs)",
    "reduce_rel": "ffn_fused_v7_final_2xh200.json (compute / fused_compute, max-rank medians, "
                  "T = 8192)",
    "nccl_busbw_gbps": "ffn_fused_v7_final_2xh200.json (busbw_bf16_GBs: NCCL bf16 all-reduce, "
                       "G = 2, T = 8192)",
    "ar_gbps_per_sm": "ffn_fused_v7_final_2xh200.json (fused_ar_layer_sms at ccta 16: bus bytes "
                      "/ s / SM, median over shapes)",
    "ar_cap_ratio": "ffn_fused_v7_final_2xh200.json (busbw_band_ar_GBs / busbw_nccl_fp32_GBs, "
                    "all SMs, median over shapes)",
}
FILES = ("ffn_baseline_h200.json", "ffn_chained_compute_h200_auto_phased_918b75d.json",
         "ffn_fused_v7_final_2xh200.json")
# rate -> (file, provenance area, GPUs the run used, unit)
RATE_FILES = {
    "torch_tflops": (FILES[0], "ffn_baseline", 1, "TFLOP/s per shape@tokens"),
    "chained_rel": (FILES[1], "chained", 1, "chained / torch speed per shape@tokens"),
    "reduce_rel": (FILES[2], "ffn", 2, "reduce kernel / torch speed per shape"),
    "nccl_busbw_gbps": (FILES[2], "ffn", 2, "GB/s bus bandwidth per shape, G = 2"),
    "ar_gbps_per_sm": (FILES[2], "ffn", 2, "GB/s bus bytes per SM"),
    "ar_cap_ratio": (FILES[2], "ffn", 2, "band all-reduce / NCCL on every SM"),
}


def _bus(world: int) -> float:
    """Bus factor of an all-reduce over `world` GPUs: bytes each GPU moves / the buffer."""
    return 2.0 * (world - 1) / world


def _k(shape, tokens):
    return f"{shape}@{tokens}"


@dataclass
class FFNRates:
    """Measured rates of one H200 (defaults: the files in ``SOURCES``, rounded; the test
    tests/test_ffn_projection.py checks them against ``from_results``)."""
    num_sms: int = 132
    torch_tflops: dict = field(default_factory=lambda: {
        "llama3-8b@8192": 687.5, "llama3-8b@32768": 636.8, "llama3-70b@8192": 649.8,
        "llama3-70b@32768": 655.0, "deepseek-v3-dense@8192": 650.2,
        "deepseek-v3-dense@32768": 644.0, "deepseek-v3-expert@8192": 648.2,
        "deepseek-v3-expert@32768": 637.1, "llama4-scout-expert@8192": 633.7,
        "llama4-scout-expert@32768": 638.0, "llama4-scout-shared@8192": 654.4,
        "llama4-scout-shared@32768": 641.2, "mixtral-8x7b-expert@8192": 645.6,
        "mixtral-8x7b-expert@32768": 615.8})
    chained_rel: dict = field(default_factory=lambda: {
        "llama3-8b@8192": 0.9607, "llama3-8b@32768": 1.0047, "llama3-70b@8192": 0.9861,
        "llama3-70b@32768": 0.9815, "deepseek-v3-dense@8192": 0.9694,
        "deepseek-v3-dense@32768": 0.9824, "deepseek-v3-expert@8192": 0.9588,
        "deepseek-v3-expert@32768": 0.9596, "llama4-scout-expert@8192": 0.9782,
        "llama4-scout-expert@32768": 0.9824, "llama4-scout-shared@8192": 0.971,
        "llama4-scout-shared@32768": 0.968, "mixtral-8x7b-expert@8192": 0.9679,
        "mixtral-8x7b-expert@32768": 1.0102})
    reduce_rel: dict = field(default_factory=lambda: {
        "llama3-8b": 0.7683, "llama3-70b": 0.7615, "deepseek-v3-dense": 0.7732,
        "deepseek-v3-expert": 0.6836, "llama4-scout-expert": 0.7763,
        "llama4-scout-shared": 0.7728, "mixtral-8x7b-expert": 0.7683})
    nccl_busbw_gbps: dict = field(default_factory=lambda: {
        "llama3-8b": 268.8, "llama3-70b": 286.7, "deepseek-v3-dense": 273.1,
        "deepseek-v3-expert": 282.6, "llama4-scout-expert": 273.2, "llama4-scout-shared": 275.5,
        "mixtral-8x7b-expert": 254.3})
    ar_gbps_per_sm: float = 11.11
    ar_cap_ratio: float = 0.911

    # ---- lookups (a shape outside the seed shapes gets the median of the measured ones) -----
    @staticmethod
    def _by_tokens(table: dict, shape: str | None, tokens: int):
        pts = {int(k.split("@")[1]): v for k, v in table.items() if k.split("@")[0] == shape}
        if not pts:
            return statistics.median(table.values())
        # the measured token count nearest in log scale
        return pts[min(pts, key=lambda t: abs(math.log(t / max(tokens, 1))))]

    def torch_rate(self, shape, tokens) -> float:
        return self._by_tokens(self.torch_tflops, shape, tokens) * 1e12

    def path_rel(self, path, shape, tokens) -> float:
        if path == "chained":
            return self._by_tokens(self.chained_rel, shape, tokens)
        return self.reduce_rel.get(shape, statistics.median(self.reduce_rel.values()))

    def busbw(self, shape, world, assumed_gbps=None) -> float:
        """NCCL bf16 bus bandwidth (bytes / s): measured at G = 2, assumed above."""
        measured = self.nccl_busbw_gbps.get(shape, statistics.median(
            self.nccl_busbw_gbps.values()))
        if world > 2 and assumed_gbps is not None:
            return assumed_gbps * 1e9
        return measured * 1e9

    @classmethod
    def from_results(cls, root=".") -> "FFNRates":
        """The same rates read from bench/results/ (``SOURCES``)."""
        def load(name):
            with open(os.path.join(root, "bench", "results", name)) as f:
                return json.load(f)
        base, chained, v7 = (load(n) for n in FILES)
        res = v7["results"]
        # the layer's ccta in that run is the default rule's (no --ccta / --fused-ccta)
        ar_sm = [_bus(r["world"]) * r["T"] * r["N"] * 4
                 / (r["times"]["fused_ar_layer_sms"]["max_rank_median_ms"] * 1e-3) / 16 / 1e9
                 for r in res if fused_default_ccta(r["O_local"]) == 16]
        return cls(
            torch_tflops={_k(r["shape"], r["tokens"]): r["tflops"] for r in base["rows"]},
            chained_rel={_k(r["shape"], r["tokens"]): r["hold_speedup"]
                         for r in chained["rows"]},
            reduce_rel={r["shape"]: r["compute_ms"]
                        / r["times"]["fused_compute"]["max_rank_median_ms"] for r in res},
            nccl_busbw_gbps={r["shape"]: r["busbw_bf16_GBs"] for r in res},
            ar_gbps_per_sm=statistics.median(ar_sm),
            ar_cap_ratio=statistics.median(r["busbw_band_ar_GBs"] / r["busbw_nccl_fp32_GBs"]
                                           for r in res))


def input_sources(root: str, rates: "FFNRates", assumptions: "Assumptions",
                  git: Git | None = None) -> dict:
    """Every rate of the projection with its value, unit, what it is and its source: the file,
    card, GPUs, date, commit and freshness (moe_overlap.provenance.result_source); the bus
    bandwidth at G > 2 and the tile sizes as stated assumptions."""
    git = git or Git(root)
    out = {}
    for k, (name, area, gpus, unit) in RATE_FILES.items():
        out[k] = dict(value=getattr(rates, k), unit=unit, what=SOURCES[k],
                      source=result_source(root, name, area, gpus=gpus, git=git,
                                           field=SOURCES[k].split(" (", 1)[1].rstrip(")")))
    out["busbw_gbps_above_2"] = dict(
        value=assumptions.busbw_gbps, unit="GB/s (None: each shape's 2-GPU value)",
        what="NCCL bf16 all-reduce bus bandwidth at G = 4 / 8",
        source=dict(file=None, stated="assumed (--busbw-gbps), not measured"))
    return out


def format_sources(inputs: dict) -> str:
    """One line per rate: name (unit): its source; the values are in the JSON."""
    return "\n".join(f"  {k} ({e['unit']}): {source_text(e['source'])}"
                     for k, e in inputs.items())


@dataclass(frozen=True)
class Assumptions:
    """What the projection assumes beyond the measured rates (written into every output)."""
    busbw_gbps: float | None = None  # NCCL bf16 bus bandwidth at G > 2; None: the 2-GPU value
    tile_m: int = 128  # compute m-tile = one band flag (both paths)
    tile_n: int = 256  # chained GEMM2 output tile width (tiles per row block = N / tile_n)

    def describe(self, rates: FFNRates | None = None) -> str:
        bws = sorted((rates or FFNRates()).nccl_busbw_gbps.values())
        bw = (f"the measured 2-GPU value of each shape ({bws[0]:.0f}-{bws[-1]:.0f} GB/s)"
              if self.busbw_gbps is None else f"{self.busbw_gbps:.0f} GB/s")
        return ("Projection, not a measurement. NCCL bf16 all-reduce bus bandwidth at G = 4 / 8 "
                f"assumed: {bw}; torch and fused compute at their G = 2-slice rates; chained "
                "bf16 band all-reduce assumed at the fp32 band all-reduce's per-SM rate")


def _units_per_block(path: str, local_hidden: int, N: int, a: Assumptions) -> int:
    """Tiles whose completion one band flag waits for (the last wave covers grid / this many
    row blocks): chained: the N / tile_n GEMM2 tiles of a row block; reduce: the hidden units of
    an m-tile (tile_o wide, two per unit where h_pair applies)."""
    if path == "chained":
        return max(1, N // a.tile_n)
    tile_o = fused_tile_o(local_hidden)
    pair = 2 if local_hidden % (2 * tile_o) == 0 else 1
    return max(1, local_hidden // tile_o // pair)


def predict(P: int, O: int, N: int, tokens: int, world: int, path: str, ccta: int,
            rates: FFNRates | None = None, shape: str | None = None,
            assumptions: Assumptions | None = None, ar_gbps_per_sm: float | None = None) -> dict:
    """Projected times (seconds) of one layer call per GPU: the reference (torch compute + NCCL
    all-reduce of the bf16 [T, N] output) and the fused `path` on ccta communication SMs.
    ``shape`` names the seed shape whose rates apply (None: medians of the measured ones)."""
    if path not in PATHS:
        raise ValueError(f"path={path!r}: choose from {PATHS}")
    if O % world:
        raise ValueError(f"hidden size {O} is not divisible by G={world}")
    rates, a = rates or FFNRates(), assumptions or Assumptions()
    S = rates.num_sms
    if not 1 <= ccta < S:
        raise ValueError(f"ccta={ccta} must be in [1, {S - 1}]")
    Ol, T = O // world, tokens
    flops = 2.0 * T * Ol * (P + N)
    bus = _bus(world)
    busbw = rates.busbw(shape, world, a.busbw_gbps)
    t_comp_ref = flops / rates.torch_rate(shape, T)
    t_nccl = bus * T * N * 2 / busbw
    t_ref = t_comp_ref + t_nccl
    grid = S - ccta
    t_comp = t_comp_ref / rates.path_rel(path, shape, T) * S / grid
    elem = 2 if path == "chained" else 4
    per_sm = rates.ar_gbps_per_sm if ar_gbps_per_sm is None else ar_gbps_per_sm
    ar_bw = min(ccta * per_sm * 1e9, rates.ar_cap_ratio * busbw)
    row_bytes = bus * N * elem
    t_ar = T * row_bytes / ar_bw
    blocks = -(-T // a.tile_m)
    last_rows = min(T, -(-grid // _units_per_block(path, Ol, N, a)) * a.tile_m,
                    blocks * a.tile_m)
    band = a.tile_m if path == "chained" else fused_default_allreduce_band_rows(Ol, a.tile_m)
    t_tail = last_rows * row_bytes / ar_bw
    t_band = min(band, T) * row_bytes / ar_bw
    t_fused = max(t_comp + t_tail, t_ar + t_band)
    return dict(t_comp_ref=t_comp_ref, t_nccl=t_nccl, t_ref=t_ref, t_comp=t_comp, t_ar=t_ar,
                t_tail=t_tail, t_fused=t_fused, speedup=t_ref / t_fused,
                bound=t_ref / max(t_comp_ref, t_nccl), ccta=ccta, busbw_gbps=busbw / 1e9,
                ar_gbps=ar_bw / 1e9, local_hidden=Ol,
                extrapolated_slice=Ol < MIN_MEASURED_SLICE)


def best_ccta(P, O, N, tokens, world, path, rates=None, shape=None, assumptions=None,
              choices=CCTA_CHOICES, **kw) -> dict:
    """``predict`` at the ccta of ``choices`` with the shortest fused time (ties: fewer SMs)."""
    rates = rates or FFNRates()
    best = None
    for c in choices:
        if c >= rates.num_sms:
            continue
        p = predict(P, O, N, tokens, world, path, c, rates, shape, assumptions, **kw)
        if best is None or p["t_fused"] < best["t_fused"] * (1 - 1e-9):
            best = p
    return best


def layer_speedup(P, O, N, tokens, world, path="reduce", ccta=None, rates=None,
                  shape=None) -> dict:
    """The model's reference / fused time of one layer (what ``FusedFFN(backend="auto")``
    decides on): ``path``'s kernel at ``ccta`` (None: the layer's default,
    ``fused_default_ccta(O / G)``)."""
    if shape is None:  # a seed shape with these dimensions gets its own rates
        shape = next((n for n, (p, o) in FFN_SHAPES.items() if (p, o) == (P, O) and N == P),
                     None)
    c = fused_default_ccta(O // world) if ccta is None else ccta
    return predict(P, O, N, tokens, world, path, c, rates, shape) | {"shape": shape}


def project(shapes=tuple(FFN_SHAPES), worlds=WORLDS, tokens=TOKENS, rates=None,
            assumptions=None) -> list[dict]:
    """One row per (shape, T, G): the reference, and each path at its best ccta (times in ms);
    "chained_goal" is the chained path with the issue's all-reduce goal met (NCCL's bus
    bandwidth on 16 SMs)."""
    rates, a = rates or FFNRates(), assumptions or Assumptions()
    rows = []
    for name in shapes:
        if name not in FFN_SHAPES:
            raise ValueError(f"unknown FFN shape {name!r}: choose from {tuple(FFN_SHAPES)}")
        P, O = FFN_SHAPES[name]
        N = P
        for T in tokens:
            for G in worlds:
                row = dict(shape=name, P=P, O=O, N=N, tokens=T, world=G, local_hidden=O // G)
                for label, path, kw in (
                        ("chained", "chained", {}), ("reduce", "reduce", {}),
                        ("chained_goal", "chained",
                         dict(ar_gbps_per_sm=rates.busbw(name, G, a.busbw_gbps) / 1e9
                              / rates.ar_cap_ratio / 16))):
                    p = best_ccta(P, O, N, T, G, path, rates, name, a, **kw)
                    row.update({
                        "t_comp_ref_ms": p["t_comp_ref"] * 1e3, "t_nccl_ms": p["t_nccl"] * 1e3,
                        "t_ref_ms": p["t_ref"] * 1e3, "bound": p["bound"],
                        "busbw_gbps": p["busbw_gbps"],
                        "extrapolated_slice": p["extrapolated_slice"],
                        f"{label}_ms": p["t_fused"] * 1e3, f"{label}_speedup": p["speedup"],
                        f"{label}_ccta": p["ccta"], f"{label}_comp_ms": p["t_comp"] * 1e3,
                        f"{label}_ar_ms": p["t_ar"] * 1e3})
                rows.append(row)
    return rows


def _check_once(results, rates):
    per, errs = [], {"speedup": [], "fused": [], "compute_layer_sms": [], "ar_layer_sms": [],
                     "reference": []}
    for r in results:
        t = r["times"]
        ms = {k: t[k]["max_rank_median_ms"] for k in
              ("fused_compute_layer_sms", "fused_ar_layer_sms")}
        c = fused_default_ccta(r["O_local"])  # the layer's ccta in that run (the default rule)
        p = predict(r["P"], r["O"], r["N"], r["T"], r["world"], "reduce", c, rates, r["shape"])
        e = {"speedup": p["speedup"] / r["speedup_vs_baseline"] - 1,
             "fused": p["t_fused"] * 1e3 / r["fused_ms"] - 1,
             "compute_layer_sms": p["t_comp"] * 1e3 / ms["fused_compute_layer_sms"] - 1,
             "ar_layer_sms": p["t_ar"] * 1e3 / ms["fused_ar_layer_sms"] - 1,
             "reference": p["t_ref"] * 1e3 / r["baseline_ms"] - 1}
        for k, v in e.items():
            errs[k].append(v)
        per.append(dict(shape=r["shape"], tokens=r["T"], ccta=c,
                        measured_fused_ms=r["fused_ms"], model_fused_ms=p["t_fused"] * 1e3,
                        measured_reference_ms=r["baseline_ms"], model_reference_ms=p["t_ref"] * 1e3,
                        measured_speedup=r["speedup_vs_baseline"], model_speedup=p["speedup"],
                        **{f"err_{k}": v for k, v in e.items()}))
    return dict(per_shape=per, summary={k: dict(mean=sum(v) / len(v),
                                                max_abs=max(abs(x) for x in v), n=len(v))
                                        for k, v in errs.items() if v})


def check_reduce(results: list[dict], rates: FFNRates | None = None) -> dict:
    """The model of the compute="reduce" path on the measured 2-GPU layer runs (``results`` of
    ffn_fused_v7_final_2xh200.json, each at the layer's own ccta): per shape predicted /
    measured - 1 of the speedup, the fused layer, its two kernels alone on their SMs, and the
    reference layer. Twice: "same_run" takes torch's compute rate from that run's own
    ``compute`` timing (every input of the model from the run it is checked on: the model's
    structure), "cross_run" from ffn_baseline_h200.json as the projection does (adds the clock
    drift between the two runs, 5-15 %, which cancels mostly in the speedup)."""
    rates = rates or FFNRates()
    same = FFNRates(**{**asdict(rates), "torch_tflops": {
        **rates.torch_tflops, **{_k(r["shape"], r["T"]): 2.0 * r["T"] * r["O_local"]
                                 * (r["P"] + r["N"]) / (r["compute_ms"] * 1e-3) / 1e12
                                 for r in results}}})
    return dict(same_run=_check_once(results, same), cross_run=_check_once(results, rates),
                chained="no 2-GPU measurement of the chained layer exists yet: its rows are "
                        "model only")


def format_table(rows: list[dict]) -> str:
    hdr = (f"{'shape':<21}{'T':>6}{'G':>3}{'O/G':>6}{'ref ms':>8}{'comp':>7}{'nccl':>7}"
           f"{'bound':>7}{'chained':>9}{'x':>6}{'ccta':>5}{'goal x':>7}{'reduce':>8}{'x':>6}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(f"{r['shape']:<21}{r['tokens']:>6}{r['world']:>3}"
                     f"{r['local_hidden']:>5}{'*' if r['extrapolated_slice'] else ' '}"
                     f"{r['t_ref_ms']:>8.3f}{r['t_comp_ref_ms']:>7.3f}{r['t_nccl_ms']:>7.3f}"
                     f"{r['bound']:>7.2f}{r['chained_ms']:>9.3f}{r['chained_speedup']:>6.2f}"
                     f"{r['chained_ccta']:>5}{r['chained_goal_speedup']:>7.2f}"
                     f"{r['reduce_ms']:>8.3f}{r['reduce_speedup']:>6.2f}")
    lines.append("* hidden slice below the narrowest measured (1024): rates held, optimistic")
    return "\n".join(lines)


def format_check(check: dict) -> str:
    """The check of one run (``check_reduce(...)["same_run"]`` or ``["cross_run"]``)."""
    lines = [f"{'shape':<21}{'ccta':>5}{'fused ms':>10}{'model':>8}{'err':>7}{'ref ms':>8}"
             f"{'model':>8}{'err':>7}{'speed':>7}{'model':>7}"]
    for p in check["per_shape"]:
        lines.append(f"{p['shape']:<21}{p['ccta']:>5}{p['measured_fused_ms']:>10.3f}"
                     f"{p['model_fused_ms']:>8.3f}{100 * p['err_fused']:>+6.0f}%"
                     f"{p['measured_reference_ms']:>8.3f}{p['model_reference_ms']:>8.3f}"
                     f"{100 * p['err_reference']:>+6.0f}%{p['measured_speedup']:>7.2f}"
                     f"{p['model_speedup']:>7.2f}")
    s = check["summary"]
    lines.append("mean / max |error|: " + ", ".join(
        f"{k} {100 * v['mean']:+.1f} % / {100 * v['max_abs']:.1f} %" for k, v in s.items()))
    return "\n".join(lines)


def link_note(inputs: dict) -> str:
    """The measured rates' cards and dates for the plot: the link rates from the last 2-GPU run,
    the compute rates from one GPU."""
    def short(k):
        s = inputs[k]["source"]
        return (f"{s['file'].rsplit('/', 1)[-1]}: {s['card']} x{s['gpus']}, {s['date']}, "
                f"{s['commit'][:7] if s['commit'] else '?'}, {s['freshness']['state']}")
    return (f"Link rates (NCCL bf16 all-reduce at G = 2, band all-reduce per SM) from the last "
            f"2-GPU run ({short('nccl_busbw_gbps')}); torch's compute rate ({short('torch_tflops')});"
            f" chained / torch ({short('chained_rel')})")


def plot(rows: list[dict], path: str, assumptions: Assumptions, check: dict | None = None,
         rates: FFNRates | None = None, inputs: dict | None = None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tokens = sorted({r["tokens"] for r in rows})
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(tokens), figsize=(6.5 * len(tokens), 4.6), sharey=True,
                             squeeze=False)
    for ax, T in zip(axes[0], tokens):
        for i, s in enumerate(shapes):
            pts = sorted((r["world"], r["chained_speedup"], r["bound"]) for r in rows
                         if r["shape"] == s and r["tokens"] == T)
            if not pts:
                continue
            g, sp, bd = zip(*pts)
            line, = ax.plot(g, sp, "-o", label=s)
            ax.plot(g, bd, ":", color=line.get_color(), lw=0.9)
        ax.axhspan(1.3, 2.6, color="tab:green", alpha=0.08, label="seed's 1.3-2.6x")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["world"] for r in rows}))
        ax.set_xticklabels([str(g) for g in sorted({r["world"] for r in rows})])
        ax.set_title(f"T = {T}: chained fused (solid) and perfect-overlap bound (dotted)")
        ax.set_xlabel("GPUs (G)")
    axes[0][0].set_ylabel("projected reference / fused")
    axes[0][-1].legend(fontsize=7)
    note = assumptions.describe(rates)
    if check:
        f = check["cross_run"]["summary"]["speedup"]
        note += (f". Model of the reduce path on the 2-GPU layer: speedup error mean "
                 f"{100 * f['mean']:+.0f} %, max |{100 * f['max_abs']:.0f}| %; chained: no 2-GPU "
                 "measurement yet")
    if inputs:
        note += ". " + link_note(inputs)
    import textwrap
    note = textwrap.fill(note, int(16 * 6.5 * len(tokens)))
    fig.set_figheight(4.6 + 0.13 * (note.count("\n") + 1))
    fig.text(0.01, 0.005, note, fontsize=7)
    fig.tight_layout(rect=(0, (0.13 * (note.count("\n") + 1) + 0.1) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows, path_json, rates: FFNRates, assumptions: Assumptions, check, meta,
          inputs: dict | None = None):
    """The JSON: meta, the assumptions, the rates, their sources (SOURCES: the fields; inputs:
    every rate with its file, card, GPUs, date, commit and freshness), the check and the rows."""
    doc = dict(meta=meta, inputs=inputs, assumptions=dict(
        asdict(assumptions), text=assumptions.describe(rates), model=__doc__.split("\n\n", 1)[1],
        ccta_choices=list(CCTA_CHOICES), seed_claim=SEED_CLAIM,
        min_measured_slice=MIN_MEASURED_SLICE),
        rates=asdict(rates), sources=SOURCES, check=check, rows=rows)
    with open(path_json, "w") as f:
        json.dump(doc, f, indent=1)
    return doc
