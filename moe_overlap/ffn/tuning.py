"""``backend="auto"`` of FusedFFN / ShardedExperts: the fused backend only where it is measured
(an FFN tune-cache entry) or modelled faster than the reference, else the reference.

Decided once, at construction, from what the layer knows then: its dimensions (P, O, N), the
world size G, dense or grouped, the token count it is sized for (``max_tokens``, else
``AUTO_TOKENS``) and the fused options given (their ccta; else the fused backend's default).
In this order:

1. the fused backend cannot run here (no CUDA Hopper GPU, CuTe DSL missing, dtype other than
   bf16, dimensions the kernels do not take, one rank): reference, saying why;
2. a tune-cache entry for the layer's shape bucket (``ffn_tune_key``) holding both backends'
   measured times: the faster one (fused only if not slower);
3. the projection model (``moe_overlap.ffn.projection.layer_speedup``, the fused backend's
   compute kernel (``compute``, "reduce" unless the layer asks for "chained") at the layer's
   ccta; ShardedExperts: the dense model on all its rows):
   fused if it projects at least ``AUTO_MIN_SPEEDUP`` x the reference's speed, else reference.
   With today's measured rates that is the reference on every seed shape at G = 2, 4 and 8
   for compute="reduce"; for compute="chained" (no 2-GPU measurement yet: the model only) the
   fused backend on most seed shapes at G = 4 and 8 and on two at G = 2.

The reason is a sentence kept on the layer (``backend_reason``, shown by ``repr``).
"""
from __future__ import annotations

import json
import math
import os

AUTO_TOKENS = 8192  # token count of the decision when the layer is not given max_tokens
# the model's reference / fused error on the measured 2-GPU layer is +-2 % on average and 6 % at
# worst (projection.check_reduce, same run): ask 5 % before trusting a modelled gain
AUTO_MIN_SPEEDUP = 1.05
CACHE_ENV = "MOE_OVERLAP_FFN_TUNE_CACHE"


def ffn_tune_key(device_name: str, world_size: int, P: int, O: int, N: int, grouped: bool,
                 tokens: int, compute: str = "reduce") -> str:
    """The shape bucket of a tune-cache entry (tokens rounded up to a power of two); the fused
    compute kernel is part of it (a measurement of one kernel says nothing of the other)."""
    bucket = 1 << max(0, math.ceil(math.log2(max(int(tokens), 1))))
    kind = "experts" if grouped else "dense"
    return f"ffn|{device_name}|G{world_size}|P{P}|O{O}|N{N}|{kind}|rows{bucket}|{compute}"


class FFNTuneCache:
    """JSON file of measured layer times per shape key: ``{key: {"fused_ms": .., "reference_ms":
    .., ...}}``. Default path: ``$MOE_OVERLAP_FFN_TUNE_CACHE``, else
    ~/.cache/moe-overlap/ffn_tune.json."""

    def __init__(self, path: str | None = None):
        self.path = path or os.environ.get(CACHE_ENV) or os.path.join(
            os.path.expanduser("~"), ".cache", "moe-overlap", "ffn_tune.json")
        self.entries: dict = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                try:
                    self.entries = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"FFN tune cache {self.path} is not valid JSON ({e})") \
                        from None
            if not isinstance(self.entries, dict):
                raise ValueError(f"FFN tune cache {self.path} must hold a JSON object")

    def get(self, key: str) -> dict | None:
        """The entry of ``key`` (both times checked: positive numbers), or None."""
        e = self.entries.get(key)
        if e is None:
            return None
        ok = isinstance(e, dict) and all(
            isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool) and e[k] > 0
            for k in ("fused_ms", "reference_ms"))
        if not ok:
            raise ValueError(f"FFN tune cache {self.path}: entry {key!r} must hold positive "
                             f"fused_ms and reference_ms, got {e!r}")
        return e

    def put(self, key: str, fused_ms: float, reference_ms: float, **info):
        self.entries[key] = {"fused_ms": float(fused_ms), "reference_ms": float(reference_ms),
                             **info}
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.entries, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def choose_backend(P: int, O: int, N: int, world_size: int, *, grouped: bool = False,
                   tokens: int | None = None, ccta: int | None = None,
                   device_name: str = "cpu", cannot_run: str | None = None,
                   cache: FFNTuneCache | None = None, rates=None,
                   compute: str = "reduce") -> tuple[str, str]:
    """("fused" | "reference", the reason): the rule of the module docstring. ``cannot_run``:
    why the fused backend cannot run here (None: it can); ``cache``: the tune cache (default
    ``FFNTuneCache()``, read only when the fused backend can run); ``rates``: the projection's
    ``FFNRates`` (default: the measured ones); ``compute``: the fused backend's compute kernel
    ("reduce" | "chained"), the one measured or modelled."""
    if compute not in ("reduce", "chained"):
        raise ValueError(f"compute={compute!r}; choose 'reduce' or 'chained'")
    T = AUTO_TOKENS if tokens is None else int(tokens)
    if world_size < 2:
        return "reference", "auto: one rank, nothing to all-reduce (the fused backend " \
                            "overlaps the all-reduce)"
    if cannot_run is not None:
        return "reference", f"auto: the fused backend cannot run here ({cannot_run})"
    cache = FFNTuneCache() if cache is None else cache
    key = ffn_tune_key(device_name, world_size, P, O, N, grouped, T, compute)
    e = cache.get(key)
    if e is not None:
        sp = e["reference_ms"] / e["fused_ms"]
        pick = "fused" if sp >= 1.0 else "reference"
        return pick, (f"auto: measured (tune cache {cache.path}, {key}): reference "
                      f"{e['reference_ms']:.3f} ms, fused {e['fused_ms']:.3f} ms = {sp:.2f}x")
    from .projection import layer_speedup
    p = layer_speedup(P, O, N, T, world_size, compute, ccta, rates)
    pick = "fused" if p["speedup"] >= AUTO_MIN_SPEEDUP else "reference"
    rates_of = f"the measured rates of {p['shape']}" if p["shape"] else \
        "the median measured rates (not a seed shape)"
    return pick, (f"auto: modelled (ffn.projection, compute={compute!r} at ccta {p['ccta']}, "
                  f"{rates_of}, G={world_size}, T={T}): fused {p['speedup']:.2f}x the "
                  f"reference (fused needs >= {AUTO_MIN_SPEEDUP:.2f}x); no tune-cache entry")
