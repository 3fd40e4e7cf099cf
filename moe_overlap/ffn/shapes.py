"""The FFN shapes every FFN bench and test uses: name -> (P = N, O), P the model width and O the
FFN's hidden size (sliced O / G over G tensor-parallel ranks)."""

FFN_SHAPES = {
    "llama3-8b": (4096, 14336),
    "llama3-70b": (8192, 28672),
    "deepseek-v3-dense": (7168, 18432),
    "deepseek-v3-expert": (7168, 2048),
    "llama4-scout-expert": (5120, 8192),
    "llama4-scout-shared": (5120, 16384),
    "mixtral-8x7b-expert": (4096, 14336),
}
