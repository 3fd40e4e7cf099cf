"""CPU checks of moe_overlap.timing helpers that do not need a GPU."""
from conftest import spawn_ranks


def _max_worker(rank, world):
    from moe_overlap.timing import max_over_ranks
    return max_over_ranks(0.25 + rank, "cpu")


def test_max_over_ranks_is_the_largest_on_every_rank():
    assert spawn_ranks(_max_worker, 3) == [2.25, 2.25, 2.25]
