"""The combine shapes the sweep and `validate` run: one table.

A shape is (tokens per rank, experts, top-k, N, K) with K the combine's input width (the expert's
intermediate size) and N its output (the model's hidden size). `MODEL_SHAPES` are the MoE layers
users run, each at `MODEL_TOKENS` tokens per rank; `SYNTHETIC_SHAPES` the benchmark's own.
"""
from __future__ import annotations

# name: (experts, top-k, K = expert intermediate size, N = hidden size)
MODELS = {
    "deepseek-v3": (256, 8, 2048, 7168),
    "qwen3-235b-a22b": (128, 8, 1536, 4096),
    "qwen3-30b-a3b": (128, 8, 768, 2048),
    "mixtral-8x7b": (8, 2, 14336, 4096),
}
MODEL_TOKENS = (4096, 16384)
SYNTHETIC = ("4096x16x4x8192x1024", "4096x16x4x8192x2048")


def shape(tokens: int, experts: int, topk: int, N: int, K: int, name: str = "") -> dict:
    d = dict(tokens=int(tokens), experts=int(experts), topk=int(topk), N=int(N), K=int(K))
    if name:
        d["name"] = name
    return d


def model_shapes(tokens=MODEL_TOKENS) -> list[dict]:
    return [shape(T, E, k, N, K, name=f"{m}@{T}") for m, (E, k, K, N) in MODELS.items()
            for T in tokens]


def parse_shapes(text: str) -> list[dict]:
    """Comma-separated items: TxExkxNxK, a model name (every MODEL_TOKENS), name@T,
    'synthetic', 'models' or 'all' (synthetic + models)."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        low = item.lower()
        if low in ("all", "synthetic"):
            out += parse_shapes(",".join(SYNTHETIC))
        if low in ("all", "models"):
            out += model_shapes()
        if low in ("all", "synthetic", "models"):
            continue
        name, _, tok = low.partition("@")
        if name in MODELS:
            E, k, K, N = MODELS[name]
            toks = (int(tok),) if tok else MODEL_TOKENS
            out += [shape(T, E, k, N, K, name=f"{name}@{T}") for T in toks]
            continue
        parts = low.split("x")
        if len(parts) != 5 or not all(p.isdigit() for p in parts):
            raise ValueError(f"shape {item!r}: TxExkxNxK, one of {sorted(MODELS)} (optionally "
                             "@tokens), synthetic, models or all")
        out.append(shape(*(int(p) for p in parts)))
    return out


def check_world(shapes: list[dict], world_size: int) -> None:
    """ValueError unless every shape's experts divide over the ranks."""
    bad = [s for s in shapes if s["experts"] % world_size]
    if bad:
        raise ValueError(f"experts not divisible by {world_size} ranks: {bad}")
