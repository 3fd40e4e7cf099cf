"""What the one-GPU emulated-rank band all-reduce runs: the cases of
tests/test_band_allreduce_onegpu_gpu.py and bench/bench_band_allreduce_onegpu.py's variants, in one
place so that tests/test_band_allreduce_onegpu_compile.py compiles (sm_90a, no GPU) exactly the
variants a GPU run will launch and checks their co-residency on an H200 (132 SMs)."""

H200_SMS = 132
TIMEOUT_NS = 5_000_000_000  # correct calls: far above any of these (and the producer's sleep)
SHORT_TIMEOUT_NS = 300_000_000  # the calls that must time out

# (partial, G, M, N, act2, bias, band_rows, ready_rows, ccta); bias None, "shared" (b2 [N]) or
# "per_band" (b2_per_band: b2 [ceil(M / ready_rows), N]); M is never a multiple of band_rows
CASES = [
    ("bf16", 2, 300, 1024, "none", None, 32, None, 3),
    ("bf16", 2, 1000, 264, "relu", "shared", 32, None, 8),  # N / 8 = 33: odd chunks
    ("bf16", 4, 300, 1024, "relu", "shared", 64, None, 4),
    ("bf16", 4, 77, 264, "none", "shared", 32, None, 2),
    ("bf16", 2, 300, 512, "relu", "per_band", 32, 128, 4),
    ("bf16", 4, 1000, 512, "none", "per_band", 32, 64, 8),
    ("bf16", 2, 300, 1024, "silu", "shared", 32, None, 4),  # fast-math act2: within tolerance
    ("fp32", 2, 300, 1024, "none", None, 128, None, 3),
    ("fp32", 2, 1000, 264, "relu", "shared", 32, None, 8),
    ("fp32", 4, 300, 512, "relu", "shared", 64, None, 4),
    ("fp32", 4, 77, 264, "none", None, 32, None, 2),
]


def call_rows(M: int) -> list:
    """The rows of the consecutive calls on one set of ranks: M twice, fewer, M again."""
    return [M, M, M // 3 + 1, M]


# producer mode (a side stream stores the partials ~20 ms late, then raises band_ready):
# (partial, G, broken); broken = _test_skip_ready_wait (the all-reduce does not wait: must fail)
PRODUCER_SHAPE = (300, 1024, 32, 128, 4)  # M, N, band_rows, ready_rows, ccta
PRODUCER_CASES = [("bf16", 2, False), ("bf16", 4, False), ("fp32", 2, False), ("bf16", 2, True)]

# one rank's expected counter a call ahead / one rank never launched: (partial, G)
ERROR_SHAPE = (300, 1024, 32, 4)  # M, N, band_rows, ccta
COUNTER_CASES = [("bf16", 2), ("bf16", 4)]
MISSING_RANK_CASES = [("bf16", 2), ("fp32", 4)]

# the bench's defaults (bench/bench_band_allreduce_onegpu.py)
BENCH_WORLD = 2
BENCH_PARTIAL = "bf16"
BENCH_CCTA = (4, 8, 16)
BENCH_BAND_ROWS = 32
BENCH_SHAPES = ((8192, 8192), (32768, 8192))


def variants():
    """Every (partial, G, act2, b2_per_band, skip_ready_wait, max ccta) the GPU test and the
    bench's defaults (and its --partial fp32) launch."""
    out = {}

    def add(partial, G, act2, per_band, skip, ccta):
        k = (partial, G, act2, per_band, skip)
        out[k] = max(out.get(k, 0), ccta)

    for partial, G, _, _, act2, bias, _, _, ccta in CASES:
        add(partial, G, act2, bias == "per_band", False, ccta)
    for partial, G, broken in PRODUCER_CASES:
        add(partial, G, "none", False, broken, PRODUCER_SHAPE[4])
    for partial, G in COUNTER_CASES + MISSING_RANK_CASES:
        add(partial, G, "none", False, False, ERROR_SHAPE[3])
    for partial in (BENCH_PARTIAL, "fp32"):
        add(partial, BENCH_WORLD, "none", False, False, max(BENCH_CCTA))
    return [k + (c,) for k, c in sorted(out.items())]
