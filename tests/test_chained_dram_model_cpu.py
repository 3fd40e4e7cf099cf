"""bench/predict_chained_dram.py, the model of the chained FFN kernel's DRAM reads per tile
order: the access stream it builds, its LRU, and its calibration against the ncu DRAM reads of
bench/results (llama3-70b, 8192 tokens: twelve kernel rows, eleven orders): every row within the
reported error, and every two rows that differ by more than the model's error ranked as
measured (the unpatched groups 4, 8 and 16, 12.2-12.9 GB, are closer than that and the model
does not resolve them: it puts 16 below 8, the GPU 3 % above); the same model without the
tiles' spread (every tile exactly simulate's duration, lock step) misses that error, so the
check can fail."""
import itertools

import numpy as np
import pytest

from conftest import load_bench

MAX_ERROR = 0.08  # the calibrated model's reported bound (5.8 % at its fit)
RANK_TOL = 0.06  # rows closer than the model's largest error (5.8 %) may swap


@pytest.fixture(scope="module")
def model():
    return load_bench("predict_chained_dram")


def test_stream_reads_every_slab_once_per_tile(model):
    """Each tile reads all its k slabs of both operands once; the writes are each tile's 64 KiB
    of H or out; the stream is in time order on the CTAs of the grid."""
    M, P, hidden, N = 2048, 1024, 2048, 1024
    s = model.schedule_of("4p2r8l4", M, P, hidden, N, grid=16)
    ids, sizes, reads, ctas = model.access_stream(s, jitter=0.03, seed=1)
    nb = s.blocks
    k1, k2 = P // 64, hidden // 64
    read_bytes = nb * s.h_tiles * k1 * (128 * 64 + 64 * 256) * 2 + \
        nb * s.n_tiles * k2 * (128 * 64 + 64 * 256) * 2
    assert int(sizes[reads].sum()) == read_bytes
    assert int(sizes[~reads].sum()) == nb * (s.h_tiles + s.n_tiles) * 128 * 256 * 2
    assert set(np.unique(ctas)) <= set(range(16))
    # an unbounded cache misses each address block once (the H slots are written first)
    inf = model.lru_read_misses(ids, sizes, reads, ctas, 1 << 60)
    assert inf == (nb * k1 * 128 + k1 * s.h_tiles * 256 + k2 * s.n_tiles * 256) * 64 * 2
    # a cache of one slab misses every read
    assert model.lru_read_misses(ids, sizes, reads, ctas, 1) == read_bytes
    # two partitions of an unbounded cache: no more misses than one
    assert model.lru_read_misses(ids, sizes, reads, ctas, 1 << 60, partitions=2) == inf


def test_measured_points_parsed(model):
    pts = model.measured_points()
    got = [(sp, round(v / 1e9, 2)) for sp, v, _ in pts]
    assert got == [("8p1", 12.44), ("1", 31.48), ("2p1", 18.44), ("4p1", 12.78),
                   ("8p1", 12.48), ("16p1", 12.88), ("8p1", 12.16), ("8p2", 10.44),
                   ("8p4", 9.33), ("16p2", 8.48), ("16p4", 7.02), ("4p4", 13.96)]


def _ranked_as_measured(rows):
    for (_, m1, x1, _), (_, m2, x2, _) in itertools.combinations(rows, 2):
        if abs(x1 / x2 - 1) > RANK_TOL and (m1 < m2) != (x1 < x2):
            return False
    return True


def test_calibrated_model_within_error_and_ranked(model):
    pts = model.measured_points()
    streams = model.point_streams(pts, model.JITTER, model.SEEDS)
    rows = model.errors(pts, streams, model.CAPACITY, model.PARTITIONS, model.SEEDS)
    worst = max(abs(r[3]) for r in rows)
    assert worst <= MAX_ERROR, rows
    assert _ranked_as_measured(rows), rows


def test_lock_step_model_misses(model):
    """Without the spread the tiles of a super-block start on one time grid and share every
    operand they have in common: the fit is worse than the reported error."""
    pts = model.measured_points()
    streams = model.point_streams(pts, 0.0, (0,))
    rows = model.errors(pts, streams, model.CAPACITY, model.PARTITIONS, (0,))
    assert max(abs(r[3]) for r in rows) > MAX_ERROR + 0.04, rows
