"""A model of the cluster mailbox of the chained kernel's cluster=2 variant
(compute_chained_sm90.ChainedFFNKernel.fetch_tile_pair / read_tile), run under random
interleavings: the barrier counts and phase parities of the kernel (full[s]: 1 arrival; empty[s]:
the CTA's readers + 1, on the leader the peer's forward, on the peer its own TMA warp; waits by
parity, a fresh barrier's previous phase counting as complete), the leader posting each tile to
both CTAs' slots, the peer forwarding its readers' release from its third tile on. Checks that
every reader of both CTAs sees the leader's tiles in order (the peer's as row block 2 q + 1),
that no slot is overwritten before every reader of its CTA read it, and that every schedule
ends (no lost or extra arrival). It checks the protocol's logic, not the PTX's memory ordering.
"""
import random

import pytest


class Mbar:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity):
        """try_wait.parity: the phase with this parity completed (the current one differs)."""
        return self.phase % 2 != parity


def _run(tiles, readers, seed, forward=True):
    rng = random.Random(seed)
    full = [[Mbar(1) for _ in range(2)] for _ in range(2)]  # [cta][slot]
    empty = [[Mbar(readers + (1 if forward or c else 0)) for _ in range(2)]
             for c in range(2)]
    slot = [[None, None] for _ in range(2)]
    unread = [[set(), set()] for _ in range(2)]  # who has not read the slot's current words
    names = {0: {f"r{i}" for i in range(readers)}, 1: {f"r{i}" for i in range(readers)} | {"tma"}}
    counter = [0]
    seen = {}

    def post(c, s, words):
        assert not unread[c][s], f"CTA {c} slot {s} overwritten before {unread[c][s]} read it"
        slot[c][s] = words
        unread[c][s] = set(names[c])

    def read(c, s, who):
        unread[c][s].discard(who)
        seen.setdefault((c, who), []).append(slot[c][s])
        return slot[c][s]

    def leader():
        n = 0
        while True:
            s, ph = n % 2, (n // 2) % 2
            while not empty[0][s].done(ph ^ 1):
                yield
            p = counter[0]
            counter[0] += 1
            kind, q = (0, p) if p < tiles else (-1, 0)
            post(1, s, (kind, 2 * q + 1, p))
            post(0, s, (kind, 2 * q, p))
            yield
            full[0][s].arrive()
            yield
            full[1][s].arrive()
            if kind < 0:
                return
            n += 1
            yield

    def peer_tma():
        n = 0
        while True:
            s, ph = n % 2, (n // 2) % 2
            while not empty[1][s].done(ph ^ 1):
                yield
            if n >= 2 and forward:
                empty[0][s].arrive()
            yield
            while not full[1][s].done(ph):
                yield
            kind = read(1, s, "tma")[0]
            yield
            empty[1][s].arrive()
            if kind < 0:
                return
            n += 1

    def reader(c, who):
        n = 0
        while True:
            s, ph = n % 2, (n // 2) % 2
            while not full[c][s].done(ph):
                yield
            kind = read(c, s, who)[0]
            yield
            empty[c][s].arrive()
            if kind < 0:
                return
            n += 1

    agents = [leader(), peer_tma()] + [reader(c, f"r{i}") for c in range(2)
                                       for i in range(readers)]
    steps = 0
    while agents:
        a = rng.choice(agents)
        try:
            next(a)
        except StopIteration:
            agents.remove(a)
        steps += 1
        assert steps < 200000, "no progress: a lost arrival (deadlock)"
    for (c, who), got in seen.items():
        want = [(0, 2 * q + c, q) for q in range(tiles)] + [(-1, c, tiles)]
        assert got == want, (c, who, got[:6])
    assert len(seen) == 2 * readers + 1


@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 7, 40])
@pytest.mark.parametrize("seed", range(40))
def test_mailbox_model_random_interleavings(tiles, seed):
    _run(tiles, readers=3, seed=seed * 101 + tiles)


def test_mailbox_model_catches_a_missing_forward():
    """The model has teeth: without the peer's forward (the leader's empty barrier counting its
    own readers only) some interleaving overwrites the peer's slot before its readers read it."""
    failures = 0
    for seed in range(200):
        try:
            _run(12, readers=3, seed=seed, forward=False)
        except AssertionError:
            failures += 1
    assert failures > 0
