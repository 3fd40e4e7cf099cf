"""A model of the chained kernel's cluster=2 variant (compute_chained_sm90.ChainedFFNKernel:
``fetch_tile_pair``, ``read_tile``, the operand ring's waits ``ring_acquire`` / ``ring_full`` /
``ring_tail``, the epilogue's named-barrier handshake, the closing cluster barrier), run under
random interleavings of both CTAs' roles: per CTA the TMA warp, ``W`` consumer warps and the store
warp, plus the copy engine that lands each issued TMA copy at a random later step.

What is modelled as in the kernel: the mbarriers (arrival counts, tx units, phases, waits by
parity with a fresh barrier's previous phase counting as complete), the mailbox (each CTA's slots
written by its own TMA warp after an exact wait for its readers, the leader's post into the
peer's inbox after the peer's forward), the ring (each stage filled by three copies: the CTA's A
tile, its own weight half and the partner's multicast half; freed by every consumer warp of both
CTAs), the error word (first record wins), the bounded waits (a timeout of ``T`` steps of the
global clock, and with ``aware`` at once when the error word is set), the TMA warp skipping a
stage it could not acquire or whose previous fill never completed, and named barriers as exact
hardware waits. Faults: a role stalls for longer than the timeout at a random point, a bounded
wait gives up at a random point, the peer's TMA warp stops posting without a record (the GPU
test's "stop_peer"). ``protocol="direct"`` with ``ring_bounded=False`` is the code before the
ring waits were bounded (the leader writing the peer's slot itself, the peer's TMA warp a reader
that posts kind -1 itself after a timeout, exact ring waits): the tests show that it hangs where
the current protocol ends. A run "hangs" when no state changes for ``no_progress`` steps.

It checks the protocol's logic, not the PTX's memory ordering.
"""
import random

import pytest

T = 4000  # the bounded waits' timeout, in steps of the global clock


class Hang(Exception):
    pass


class Mbar:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, tx=0):
        # an arrive on a phase whose arrivals are all in would take the pending count below
        # zero (undefined in hardware): the protocol must never do it
        assert self.pending > 0, "arrive on a phase with no arrival pending"
        self.pending -= 1
        self.tx += tx
        self._complete()

    def complete_tx(self, n=1):
        self.tx -= n  # may go negative: bytes that land before the stage is armed
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity):
        """try_wait.parity: the phase with this parity completed (the current one differs)."""
        return self.phase % 2 != parity


class State:
    """cutlass.pipeline.PipelineState: (index, phase), producers start at phase 1."""

    def __init__(self, stages, phase):
        self.stages, self.index, self.phase = stages, 0, phase

    def advance(self):
        self.index += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1


class NamedBarrier:
    """bar.arrive / bar.sync with ``count`` warps per generation (exact, in hardware)."""

    def __init__(self, count):
        self.count, self.arrived, self.gen = count, 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.gen = 0, self.gen + 1
        return self.gen


class Model:
    def __init__(self, tiles, seed, k=3, stages=2, warps=2, epi=2, protocol="relay",
                 ring_bounded=True, aware=True, fault=None, forward=True):
        self.rng = random.Random(seed)
        self.tiles, self.k, self.stages, self.warps, self.epi = tiles, k, stages, warps, epi
        self.protocol, self.ring_bounded, self.aware = protocol, ring_bounded, aware
        self.fault, self.forward = fault, forward
        self.now = 0
        self.progress = 0
        self.err = None
        self.counter = 0
        self.readers = warps + 1  # consumer warps + the store warp
        extra = 1 if protocol == "direct" else 0  # the leader: the forward; the peer: its TMA warp
        self.full = [[Mbar(1) for _ in range(2)] for _ in range(2)]
        self.empty = [[Mbar(self.readers + extra) for _ in range(2)] for _ in range(2)]
        self.inbox_full = [Mbar(1) for _ in range(2)]  # on the peer
        self.inbox_free = [Mbar(1) for _ in range(2)]  # on the leader
        self.slot = [[None, None] for _ in range(2)]
        self.inbox = [None, None]
        self.inbox_unread = [False, False]
        self.unread = [[set(), set()] for _ in range(2)]
        self.names = [{f"c{w}" for w in range(warps)} | {"store"} for _ in range(2)]
        if protocol == "direct":
            self.names[1].add("tma")
        self.ring_full = [[Mbar(1) for _ in range(stages)] for _ in range(2)]
        self.ring_empty = [[Mbar(2 * warps) for _ in range(stages)] for _ in range(2)]
        self.tags = [[{} for _ in range(stages)] for _ in range(2)]  # part -> (p, k) landed
        self.epi_full = [NamedBarrier(warps + 1) for _ in range(2)]
        self.epi_empty = [NamedBarrier(warps + 1) for _ in range(2)]
        self.copies = []  # (cta, stage, part, tag) in flight
        self.seen = {}  # (cta, role) -> the words it took, in order
        self.violations = []  # what the direct protocol gets wrong (a slot overwritten unread)
        self.waits = {}  # role -> number of bounded waits it began (fault sites)
        self.stalls = {}  # the store warp -> its tiles begun (stall sites)
        self.longest_wait = 0
        self.cluster_arrived = 0
        self.roles = 0

    # ---------------------------------------------------------------- primitives
    def record(self, what):
        if self.err is None:
            self.err = what
        self.progress += 1

    def fault_here(self, kind, who):
        f = self.fault
        return f is not None and f[0] == kind and f[1] == who and self.waits.get(who) == f[2]

    def stall(self, steps):
        """The role stops for ``steps`` of the global clock (a long wait of its own)."""
        t0 = self.now
        while self.now - t0 < steps:
            yield

    def exact(self, bar, parity):
        while not bar.done(parity):
            yield

    def bounded(self, bar, parity, who, what, aware=None):
        """A bounded wait; returns True when the phase completed, False after a give-up."""
        aware = self.aware if aware is None else aware
        self.waits[who] = self.waits.get(who, 0) + 1
        if self.fault_here("give_up", who):
            self.record(("forced give-up", who, what))
            return False
        if self.fault_here("stall", who):
            yield from self.stall(self.fault[3])
        t0 = self.now
        while not bar.done(parity):
            if aware and self.err is not None:
                self.progress += 1
                return False
            if self.now - t0 > T:
                self.record(("timeout", who, what))
                return False
            yield
        self.longest_wait = max(self.longest_wait, self.now - t0)
        return True

    def ring_wait(self, bar, parity, who, what):
        if not self.ring_bounded:
            yield from self.exact(bar, parity)
            return True
        return (yield from self.bounded(bar, parity, who, what))

    def named_sync(self, bar):
        gen = bar.gen
        bar.arrive()
        self.progress += 1
        while bar.gen == gen:
            yield

    def post(self, c, s, words):
        if self.unread[c][s]:
            self.violations.append(f"CTA {c} slot {s} overwritten before {self.unread[c][s]} "
                                   f"read it")
        self.slot[c][s] = words
        self.unread[c][s] = set(self.names[c])
        self.progress += 1

    def read(self, c, s, who):
        self.unread[c][s].discard(who)
        self.seen.setdefault((c, who), []).append(self.slot[c][s])
        self.progress += 1
        return self.slot[c][s]

    # ---------------------------------------------------------------- mailbox
    def fetch(self, c, n):
        """The TMA warp's fetch_tile_pair (protocol "relay": the kernel's)."""
        s, ph = n % 2, (n // 2) % 2
        who = ("tma", c)
        if self.protocol == "direct":
            return (yield from self.fetch_direct(c, n))
        yield from self.exact(self.empty[c][s], ph ^ 1)
        words = (-1, 0, self.tiles)
        if c == 0:
            ok = True
            if self.forward:
                ok = yield from self.bounded(self.inbox_free[s], ph ^ 1, who, "forward")
            if ok:
                p = self.counter
                self.counter += 1
                kind, q = (0, p) if p < self.tiles else (-1, 0)
                yield
                if self.inbox_unread[s]:
                    self.violations.append(f"inbox slot {s} overwritten before the peer read it")
                self.inbox[s] = (kind, 2 * q + 1, p)
                self.inbox_unread[s] = True
                self.progress += 1
                yield
                self.inbox_full[s].arrive()
                words = (kind, 2 * q, p)
        else:
            if self.fault is not None and self.fault[0] == "stop_peer" and n == self.fault[1]:
                ok = False
            else:
                ok = yield from self.bounded(self.inbox_full[s], ph, who, "post")
            if ok:
                words = self.inbox[s]
                self.inbox_unread[s] = False
                self.progress += 1
                yield
                self.inbox_free[s].arrive()
        yield
        self.post(c, s, words)
        yield
        self.full[c][s].arrive()
        self.seen.setdefault((c, "tma"), []).append(words)
        return words

    def fetch_direct(self, c, n):
        """fetch_tile_pair as it was: the leader writes both CTAs' slots after a bounded wait on
        its empty barrier (its readers + the peer's forward; timeout only); the peer forwards
        its readers' release from its third tile on, waits (bounded) for the post, posts kind -1
        itself on a timeout and reads its slot as a reader."""
        s, ph = n % 2, (n // 2) % 2
        who = ("tma", c)
        if c == 0:
            ok = yield from self.bounded(self.empty[0][s], ph ^ 1, who, "empty", aware=False)
            p = self.tiles
            if ok:
                p = self.counter
                self.counter += 1
            kind, q = (0, p) if p < self.tiles else (-1, 0)
            yield
            self.post(1, s, (kind, 2 * q + 1, p))
            self.post(0, s, (kind, 2 * q, p))
            yield
            self.full[0][s].arrive()
            yield
            self.full[1][s].arrive()
            words = (kind, 2 * q, p)
            self.seen.setdefault((c, "tma"), []).append(words)
            return words
        yield from self.exact(self.empty[1][s], ph ^ 1)
        if n >= 2:
            self.empty[0][s].arrive()
        yield
        if self.fault is not None and self.fault[0] == "stop_peer" and n == self.fault[1]:
            ok = False
        else:
            ok = yield from self.bounded(self.full[1][s], ph, who, "post", aware=False)
        if not ok:
            self.post(1, s, (-1, 0, self.tiles))
            yield
            self.full[1][s].arrive()
        yield from self.exact(self.full[1][s], ph)
        words = self.read(1, s, "tma")
        yield
        self.empty[1][s].arrive()
        return words

    def read_tile(self, c, n, who):
        s, ph = n % 2, (n // 2) % 2
        yield from self.exact(self.full[c][s], ph)
        words = self.read(c, s, who)
        yield
        self.empty[c][s].arrive()
        return words

    # ---------------------------------------------------------------- roles
    def tma(self, c):
        who = ("tma", c)
        st = State(self.stages, 1)
        stopped = False
        n = 0
        words = yield from self.fetch(c, n)
        while words[0] >= 0:
            p = words[2]
            for k in range(self.k):
                i = st.index
                if self.ring_bounded:
                    # ring_acquire: after one stage not armed, none; a stage whose previous
                    # fill is incomplete is not armed
                    ok = False
                    if not stopped:
                        ok = yield from self.ring_wait(self.ring_empty[c][i], st.phase, who,
                                                       "acquire")
                        ok = ok and self.ring_full[c][i].done(st.phase)
                        stopped = not ok
                        yield
                else:
                    ok = yield from self.ring_wait(self.ring_empty[c][i], st.phase, who,
                                                   "acquire")
                if ok:
                    self.ring_full[c][i].arrive(tx=3)
                    self.copies += [(c, i, "a", (p, k)), (c, i, ("w", c), (p, k)),
                                    (1 - c, i, ("w", c), (p, k))]
                    self.progress += 1
                st.advance()
                yield
            n += 1
            if self.fault is not None and self.fault[0] == "stall_leader" and c == 0 \
                    and n == self.fault[1]:
                yield from self.stall(self.fault[2])
            words = yield from self.fetch(c, n)
        for _ in range(self.stages):
            yield from self.ring_wait(self.ring_empty[c][st.index], st.phase, who, "tail")
            st.advance()
        yield from self.cluster_barrier()

    def consumer(self, c, w):
        who = (f"c{w}", c)
        read, rel = State(self.stages, 0), State(self.stages, 0)
        n = 0
        while True:
            words = yield from self.read_tile(c, n, f"c{w}")
            if words[0] < 0:
                break
            for k in range(self.k):
                i = read.index
                ok = yield from self.ring_wait(self.ring_full[c][i], read.phase, who, "full")
                if ok and self.fault is None:
                    # the stage holds this tile's k-th slab: the CTA's A tile, both halves
                    want = {"a": (words[2], k), ("w", 0): (words[2], k), ("w", 1): (words[2], k)}
                    assert self.tags[c][i] == want, (c, i, self.tags[c][i], want)
                read.advance()
                yield
                if k > 0:  # mma_tile: the previous stage once this one's WGMMAs are issued
                    yield from self.release(c, rel)
            yield from self.release(c, rel)
            for _ in range(self.epi):
                yield from self.named_sync(self.epi_empty[c])
                self.epi_full[c].arrive()
                self.progress += 1
                yield
            n += 1
        yield from self.cluster_barrier()

    def release(self, c, rel):
        """consumer_release: each consumer warp arrives on the stage's empty barrier of both
        CTAs (the multicast's signaling lanes)."""
        for d in (c, 1 - c):
            self.ring_empty[d][rel.index].arrive()
            self.progress += 1
            yield
        rel.advance()

    def store(self, c):
        who = ("store", c)
        n = 0
        while True:
            # a counter wait's site (not modelled: a place to stall)
            self.stalls[who] = self.stalls.get(who, 0) + 1
            if self.fault is not None and self.fault[:3] == ("stall", who, self.stalls[who]):
                yield from self.stall(self.fault[3])
            words = yield from self.read_tile(c, n, "store")
            if words[0] < 0:
                break
            for _ in range(self.epi):
                self.epi_empty[c].arrive()
                self.progress += 1
                yield from self.named_sync(self.epi_full[c])
                yield
            n += 1
        yield from self.cluster_barrier()

    def copy_engine(self):
        while True:
            if self.copies:
                c, i, part, tag = self.copies.pop(self.rng.randrange(len(self.copies)))
                self.tags[c][i][part] = tag
                self.ring_full[c][i].complete_tx(1)
                self.progress += 1
            yield

    def cluster_barrier(self):
        self.cluster_arrived += 1
        self.progress += 1
        while self.cluster_arrived < self.roles:
            yield

    # ---------------------------------------------------------------- run
    def run(self, no_progress=None):
        no_progress = no_progress or 6 * T
        agents = [self.tma(c) for c in range(2)] + [self.store(c) for c in range(2)] + \
            [self.consumer(c, w) for c in range(2) for w in range(self.warps)]
        self.roles = len(agents)
        engine = self.copy_engine()
        last, idle = self.progress, 0
        while agents:
            a = self.rng.choice(agents + [engine])
            try:
                next(a)
            except StopIteration:
                agents.remove(a)
            self.now += 1
            if self.progress != last:
                last, idle = self.progress, 0
            else:
                idle += 1
                if idle > no_progress:
                    raise Hang(f"no progress after {no_progress} steps (step {self.now}, error "
                               f"{self.err})")
        return self

    def check_agreement(self):
        """Every role of a CTA took the same tiles (the TMA warp's posts included)."""
        for c in range(2):
            got = {who: seq for (cc, who), seq in self.seen.items() if cc == c}
            first = got.get("tma")
            for who, seq in got.items():
                assert seq == first, (c, who, seq[:8], first[:8])


def _fault(rng, tiles, kind):
    """A random fault of ``kind`` at a random point: which role, at which of the bounded waits
    it makes in a run without faults (the same count in every interleaving)."""
    if kind in ("give_up", "stall"):
        m = Model(tiles, seed=0).run()
        sites = {**m.waits, **(m.stalls if kind == "stall" else {})}
        who = rng.choice(sorted(sites))
        at = rng.randrange(1, sites[who] + 1)
        if kind == "give_up":
            return ("give_up", who, at)
        return ("stall", who, at, rng.randrange(T + 1, 3 * T))
    if kind == "stall_leader":
        return ("stall_leader", rng.randrange(1, tiles), rng.randrange(2 * T, 3 * T))
    return ("stop_peer", rng.randrange(1, tiles))


@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 7, 20])
@pytest.mark.parametrize("seed", range(30))
def test_model_without_faults_is_exact(tiles, seed):
    """Every role of both CTAs takes the leader's tiles in order (the peer's as row block
    2 q + 1), every stage a consumer waited for holds its tile's slab from all three copies, no
    slot or inbox is overwritten unread, no phase is armed twice, nothing times out."""
    m = Model(tiles, seed=seed * 101 + tiles).run()
    assert m.err is None and not m.violations, (m.err, m.violations)
    for (c, who), got in m.seen.items():
        want = [(0, 2 * q + c, q) for q in range(tiles)] + [(-1, c, tiles)]
        assert got == want, (c, who, got[:6])
    assert len(m.seen) == 2 * (m.readers + 1)
    assert m.longest_wait < T // 4, m.longest_wait  # the timeout is far from normal waits


@pytest.mark.parametrize("kind", ["give_up", "stall", "stall_leader", "stop_peer"])
@pytest.mark.parametrize("seed", range(40))
def test_model_every_role_ends_after_a_fault(kind, seed):
    """One CTA stalls past the timeout, gives up a bounded wait, or stops posting, at a random
    point: every role of both CTAs still reaches the cluster barrier, the error word is set
    (where a wait was cut short), the roles of each CTA agree on every tile, and no slot, inbox
    or ring phase is written twice."""
    rng = random.Random(seed)
    tiles = rng.randrange(2, 9)
    fault = _fault(rng, tiles, kind)
    m = Model(tiles, seed=seed, fault=fault).run()
    assert not m.violations, m.violations
    m.check_agreement()
    # a stall at a random point records nothing when no bounded wait of the other roles
    # outlasts it (e.g. they already wait in the closing barrier); the other faults always
    # cut a wait short
    if kind != "stall":
        assert m.err is not None, fault
    if kind == "stop_peer":  # nobody recorded: only the leader's own timeouts can end it
        assert m.err[0] == "timeout" and m.err[1][1] == 0, m.err


def test_model_stop_peer_names_the_ring():
    """The GPU test's "stop_peer": the peer stops posting without a record, so the first error
    is the leader's ring wait (its consumers' full wait or its TMA warp's acquire)."""
    names = set()
    for seed in range(20):
        m = Model(6, seed=seed, fault=("stop_peer", 2), k=4).run()
        assert m.err[0] == "timeout" and m.err[1][1] == 0, m.err
        names.add(m.err[2])
    assert names <= {"full", "acquire", "tail"} and "full" in names, names


@pytest.mark.parametrize("kind", ["stall_leader", "stop_peer"])
def test_model_with_exact_ring_waits_hangs(kind):
    """The model has teeth: with the ring's waits exact (the base pipeline's), the same
    divergence (the peer stops, the leader takes one more tile and waits for the peer's half of
    its stages, or for stages the peer never frees) hangs every time, in the mailbox of the code
    before this change ("direct") as in the current one."""
    for protocol in ("direct", "relay"):
        hangs = 0
        for seed in range(10):
            rng = random.Random(seed)
            tiles = rng.randrange(3, 9)
            fault = _fault(rng, tiles, kind)
            try:
                Model(tiles, seed=seed, fault=fault, ring_bounded=False, aware=False,
                      protocol=protocol).run()
            except Hang:
                hangs += 1
        assert hangs == 10, (protocol, kind, hangs)


def test_model_direct_mailbox_splits_a_cta():
    """Why the inbox: with the leader writing the peer's slot itself and the peer posting kind -1
    itself after a timeout, a leader's post that comes after the peer's own (its stall ended
    about when the peer's wait timed out) overwrites the slot and completes a second phase of
    its full barrier: a reader of the peer that had not yet read the slot then waits for a
    phase that never comes, or reads another tile than its CTA's other roles (a named-barrier
    hang in the kernel), even with the ring's waits bounded. The same runs end with the inbox
    (the last assertion)."""
    bad = 0
    for seed in range(200):
        rng = random.Random(seed)
        tiles = rng.randrange(3, 9)
        # the leader's stall ends about when the peer's wait for its post times out
        fault = ("stall_leader", rng.randrange(1, tiles), T + rng.randrange(-T // 8, T // 8))
        m = Model(tiles, seed=seed, fault=fault, protocol="direct")
        try:
            m.run()
            m.check_agreement()
            bad += bool(m.violations)
        except (Hang, AssertionError):
            bad += 1
        relay = Model(tiles, seed=seed, fault=fault).run()
        assert not relay.violations
        relay.check_agreement()
    assert bad > 0


def test_model_catches_a_missing_forward():
    """The model has teeth for the inbox too: a leader that does not wait for the peer's forward
    overwrites an inbox slot the peer has not read once the peer's TMA warp falls behind (here:
    it pauses, shorter than the timeout, at a random wait)."""
    failures = 0
    for seed in range(50):
        rng = random.Random(seed)
        m = Model(12, seed=seed, forward=False, k=1,
                  fault=("stall", ("tma", 1), rng.randrange(1, 12), T // 8))
        try:
            m.run()
            failures += bool(m.violations)
        except (Hang, AssertionError):
            failures += 1
    assert failures > 0
