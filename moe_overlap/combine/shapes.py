"""MoE model shapes of the combine's benchmarks and validation (one table, one place)."""
from __future__ import annotations

# name: (experts E, top-k, combine K = the expert's intermediate size, N = the model's hidden size)
MODEL_SHAPES = {
    "deepseek-v3": (256, 8, 2048, 7168),
    "qwen3-235b-a22b": (128, 8, 1536, 4096),
    "qwen3-30b-a3b": (128, 8, 768, 2048),
    "mixtral-8x7b": (8, 2, 14336, 4096),
}
