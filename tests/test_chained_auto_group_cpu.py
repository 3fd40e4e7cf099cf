"""group="auto" / patch="auto" of the chained FFN kernel (compute_chained.auto_group, auto_patch):
on the shapes of its GPU measurement (variants timed interleaved and then each sustained alone
at the power cap) it takes, among the measured variants that keep the activation-memory cap,
one within 1.5 % of the best sustained one on every point where one keeps it (in-sample), and
it keeps the rule's promises (the largest of 16, 8, 4, 2 whose ring holds at most
``ring_cap_blocks``: issue 17's activation bound; else at most half of H's row blocks; else the
largest within 1.25x the fewest blocks; else 1; patch 4 from group 8 up). The activation model behind the bound is
checked against the measured peaks. The instance's group="auto" tries ``auto_phased`` first:
tests/test_chained_auto_phased_cpu.py."""
import glob
import json
import pathlib

import pytest
import torch

from moe_overlap.ffn.compute_chained import (ACTIVATION_CAP, AUTO_GROUPS, ChainedFFNCompute,
                                             activation_bytes, auto_group, auto_patch,
                                             baseline_activation_bytes, ring_cap_blocks,
                                             schedule_for)

# the measurement the rule was chosen from (one H200, the seven slices at 8192 and 32768 tokens;
# variants: the previous rule's choice ("auto"), 8p4, 8p8, 16p4)
RESULTS = sorted(glob.glob(str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
                               / "ffn_chained_compute_h200_holds_patch_606dff6.json")))
ROWS = [r for f in RESULTS for r in json.loads(pathlib.Path(f).read_text())["rows"]
        if "variants" in r]
# points where every variant of that measurement breaks the activation bound (against the
# baseline with its activation in place), so the rule's choice there was not among them (its
# sustained rate is the next GPU run's: bench/NOTES.md, session 16); the test requires this set
# to be exactly those points: the wide slices at 8192 tokens
UNMEASURED_CHOICE = {(s, 8192) for s in ("llama3-8b", "llama3-70b", "deepseek-v3-dense",
                                         "llama4-scout-shared", "mixtral-8x7b-expert")}
# files with the measured activation peaks of both paths (variants of several rings; their
# baseline ran gelu out of place)
MEM_RESULTS = [pathlib.Path(__file__).resolve().parents[1] / "bench" / "results" / n
               for n in ("ffn_chained_compute_h200_groups_8192_c294d29.json",
                         "ffn_chained_compute_h200_auto_patch_7dea59e.json")]


def _held(M, P, hidden, N, g, grid=132):
    return min(schedule_for(M, P, hidden, N, grid, group=g).ring, -(-M // 128))


def test_measurement_has_every_shape_at_both_token_counts():
    assert len({(r["shape"], r["tokens"]) for r in ROWS}) == 14
    assert all("hold_speedup" in v for r in ROWS for v in r["variants"].values())


def _variant(r, g, patch):
    """The measured variant that ran (group g, patch): "GpC", or the previous rule's "auto"
    where it ran that group unpatched."""
    if f"{g}p{patch}" in r["variants"]:
        return f"{g}p{patch}"
    v = r["variants"]["auto"]
    assert patch == 1 and v["group_run"] == g, (r["shape"], r["tokens"], g, patch)
    return "auto"


def _capped(r):
    """The row's measured variants whose ring keeps ``ring_cap_blocks``: {name: hold_speedup}."""
    M, hidden, N = r["tokens"], r["hidden_slice"], r["N"]
    blocks, cap = -(-M // 128), ring_cap_blocks(M, hidden, N)
    return {name: v["hold_speedup"] for name, v in r["variants"].items()
            if min(v["ring"], blocks) <= cap}


def test_unmeasured_choices_are_where_the_cap_moved_it_below_every_measured_ring():
    """The points left out below: every measured variant's ring is above ``ring_cap_blocks`` and
    the choice's is not (elsewhere where none keeps it, deepseek-v3-expert's narrow slice at
    8192 tokens, the choice breaks it too: the rule's last clause, measured)."""
    moved = set()
    for r in ROWS:
        M, P, hidden, N = r["tokens"], r["P"], r["hidden_slice"], r["N"]
        g = auto_group(M, P, hidden, N, r["variants"]["auto"]["grid"])
        if not _capped(r) and _held(M, P, hidden, N, g) <= ring_cap_blocks(M, hidden, N):
            moved.add((r["shape"], M))
    assert moved == UNMEASURED_CHOICE


@pytest.mark.parametrize("r", [r for r in ROWS if (r["shape"], r["tokens"]) not in
                               UNMEASURED_CHOICE], ids=lambda r: f"{r['shape']}@{r['tokens']}")
def test_choice_on_the_measurement_it_was_chosen_from(r):
    """In-sample (the rule was chosen from this file; no held-out run compares it with other
    orders under the bound: the H100 runs after it measured ``auto_phased``'s orders beside it):
    the choice was measured and is within 1.5 % of the best measured variant under the bound
    (of all measured, where none keeps it)."""
    grid = r["variants"]["auto"]["grid"]
    M, P, hidden, N = r["tokens"], r["P"], r["hidden_slice"], r["N"]
    g = auto_group(M, P, hidden, N, grid)
    k = _variant(r, g, auto_patch(g))  # the choice was measured
    # 1.5 %: one 2 s hold per variant; the same slice (llama3-8b, mixtral-8x7b-expert) differs
    # by up to 0.5 % between its two rows
    pool = _capped(r) or {name: v["hold_speedup"] for name, v in r["variants"].items()}
    assert r["variants"][k]["hold_speedup"] >= 0.985 * max(pool.values()), (r["shape"], M, k,
                                                                             pool)
    assert schedule_for(M, P, hidden, N, grid, group=g).ring == r["variants"][k]["ring"]


def _mem_rows():
    out = []
    for f in MEM_RESULTS:
        for r in json.loads(f.read_text())["rows"]:
            for name, v in r.get("variants", {}).items():
                out.append((f.name, r, name, v))
    return out


def test_activation_model_matches_the_measured_peaks():
    rows = _mem_rows()
    assert len(rows) == 14 + 6 * 5  # the headline's 14, five variants on six slices
    for f, r, name, v in rows:
        M, hidden, N = r["tokens"], r["hidden_slice"], r["N"]
        assert r["act"] == "gelu"
        assert baseline_activation_bytes(M, hidden, N, act_in_place=False) \
            == r["activation_mem_baseline"], (f, r)
        # these files were measured while the kernel read b1 only in fp32: the bench's bf16
        # b1 was copied per call (the model's term for a b1 of a dtype read as a copy)
        model = activation_bytes(M, hidden, N, min(v["ring"], -(-M // 128)) * 128,
                                 b1_dtype=torch.float16)
        # equal on all but two rows (group 4 on the 7168-wide slices: 1 MiB above, under 1 % of
        # the call's; the caching allocator's, not a tensor of the call's)
        assert v["activation_mem"] - model in (0, 1 << 20), (f, r["shape"], M, name)


def test_measured_bound_breaches_are_the_points_the_cap_moves():
    """The headline's points above the bound against the in-place baseline (H + out; group 8's
    ring there: 0.68-0.72x by the model checked above) are those where ``ring_cap_blocks`` is
    below half of H; the rule's choice there is under the bound."""
    over = set()
    for f, r, name, v in _mem_rows():
        M, hidden, N = r["tokens"], r["hidden_slice"], r["N"]
        if f.endswith("7dea59e.json") and hidden >= N \
                and v["activation_mem"] > ACTIVATION_CAP * baseline_activation_bytes(M, hidden, N):
            over.add((r["shape"], M))
    assert over == UNMEASURED_CHOICE
    for shape, M in over:
        r = next(r for _, r, _, _ in _mem_rows() if (r["shape"], r["tokens"]) == (shape, M))
        hidden, N, P = r["hidden_slice"], r["N"], r["P"]
        assert ring_cap_blocks(M, hidden, N) < -(-M // 128) // 2
        g = auto_group(M, P, hidden, N, 132)
        ring = min(schedule_for(M, P, hidden, N, 132, group=g).ring, -(-M // 128))
        assert activation_bytes(M, hidden, N, ring * 128) \
            <= ACTIVATION_CAP * baseline_activation_bytes(M, hidden, N)


# the G = 2 slices (hidden, N) of the seed shapes with hidden >= N
SEED_WIDE = [(7168, 4096), (14336, 8192), (9216, 7168), (8192, 5120)]


@pytest.mark.parametrize("M", [1024, 4096, 8192, 12288, 16384, 32768, 65536])
@pytest.mark.parametrize("hidden,N", SEED_WIDE + [(8192, 8192), (4096, 4096), (1024, 7168),
                                                  (4096, 5120)])
def test_rule_keeps_the_activation_bound(M, hidden, N):
    """Wherever the bound leaves a group (the first clause), out + ring <= 0.6x the baseline's
    peak on slices with hidden >= N, and never above the baseline's (a bf16 b1 is read as it
    is, so no per-call bias copy is added where the ring holds all of H); on the seed's wide
    slices from 8192 tokens up the first clause always applies (at 4096 it does not: the bound
    leaves 9-11 of 32 blocks, below group 2's ring on most)."""
    P = N
    blocks = -(-M // 128)
    g = auto_group(M, P, hidden, N, 132)
    ring = min(schedule_for(M, P, hidden, N, 132, group=g).ring, blocks)
    ours = activation_bytes(M, hidden, N, ring * 128)
    base = baseline_activation_bytes(M, hidden, N)
    assert ours <= base
    if hidden >= N and ring <= ring_cap_blocks(M, hidden, N):
        assert ours <= ACTIVATION_CAP * base
    if (hidden, N) in SEED_WIDE and M >= 8192:
        assert ring <= ring_cap_blocks(M, hidden, N) and ours <= ACTIVATION_CAP * base, \
            (g, ring, blocks)


RULE_CASES = [(8192, 4096, 7168, 4096), (32768, 8192, 14336, 8192), (1000, 8192, 14336, 8192),
              (8192, 7168, 1024, 7168), (4096, 4096, 7168, 4096), (300, 512, 1024, 512),
              (100, 4096, 7168, 4096)]


def _clause(M, P, hidden, N, grid):
    """Which of the rule's promises applies: the first limit some group of AUTO_GROUPS keeps its
    ring within ("cap", then "half"), "near" (none does), with the rings held."""
    blocks = -(-M // 128)
    held = {g: _held(M, P, hidden, N, g, grid) for g in AUTO_GROUPS + (1,)}
    for name, limit in (("cap", ring_cap_blocks(M, hidden, N)), ("half", blocks // 2)):
        if any(held[c] <= limit for c in AUTO_GROUPS):
            return name, limit, held
    return "near", 5 * min(held.values()) / 4, held


@pytest.mark.parametrize("M,P,hidden,N", RULE_CASES)
@pytest.mark.parametrize("grid", [132, 64, 16])
def test_rule_keeps_the_first_limit_it_can_with_the_largest_group(M, P, hidden, N, grid):
    """The properties the rule promises: where any group's ring keeps the activation bound
    (``ring_cap_blocks``), the chosen one's does and no larger group's (more blocks sharing each
    weight panel) does; else the same with half of H's blocks; else the chosen ring is within
    1.25x the fewest blocks any order holds (group 1 included) and no larger group's is, or,
    where none of AUTO_GROUPS is, group 1. The cap is never above half of H."""
    g = auto_group(M, P, hidden, N, grid)
    assert ring_cap_blocks(M, hidden, N) <= -(-M // 128) // 2
    clause, limit, held = _clause(M, P, hidden, N, grid)
    larger = [c for c in AUTO_GROUPS if c > g]
    assert all(held[c] > limit for c in larger), (clause, g, held, limit)
    if g == 1:  # no group of AUTO_GROUPS (all larger) within the limit: only the last clause
        assert clause == "near", (g, held, limit)
    else:
        assert held[g] <= limit, (clause, g, held, limit)


def test_rule_cases_reach_every_clause():
    """Not vacuous: the cases above take each clause, and group 1, at least once."""
    seen = {(_clause(*c, grid)[0], auto_group(*c, grid) == 1) for c in RULE_CASES
            for grid in (132, 64, 16)}
    assert {k for k, _ in seen} == {"cap", "half", "near"} and ("near", True) in seen


def test_few_rows_take_the_largest_group():
    # every ring covers all 8 blocks: no group holds less of H, so the one sharing most panels
    assert auto_group(1024, 8192, 14336, 8192, 132) == 16


def test_patch_rule():
    assert [auto_patch(g) for g in (1, 2, 4, 8, 16)] == [1, 1, 1, 4, 4]
    M, P, hidden, N = 32768, 8192, 14336, 8192
    # where no phased order is chosen (deepseek-v3-expert's slice: 4 hidden column tiles)
    c = ChainedFFNCompute()
    assert c.patch == "auto"
    Pe, he, Ne = 7168, 1024, 7168
    assert c.phased_for(M, Pe, he, Ne, 132) is None
    s = c.schedule(M, Pe, he, Ne, 132)
    assert (s.group, s.patch) == (16, 4)
    # group="auto" with an explicit split leaves the phased rule out: auto_group, auto_patch
    s = ChainedFFNCompute(split="auto").schedule(M, P, hidden, N, 132)
    assert (s.group, s.patch) == (16, 4)
    assert ChainedFFNCompute(group=8, patch=1).schedule(M, P, hidden, N, 132).patch == 1


def test_instance_default_is_auto_and_consistent():
    c = ChainedFFNCompute()
    assert c.group == "auto"
    M, P, hidden, N = 32768, 7168, 1024, 7168  # no phased order: auto_group's
    g = c.group_for(M, P, hidden, N, 132)
    assert g == auto_group(M, P, hidden, N, 132) == 16
    s = c.schedule(M, P, hidden, N, 132)
    assert s.group == g
    assert c.ring_bytes(M, P, hidden, N, 132) == s.ring_bytes
    assert ChainedFFNCompute(group=4).group_for(M, P, hidden, N, 132) == 4


@pytest.mark.parametrize("kw,msg", [(dict(group="fast"), "group"), (dict(group=0), "group"),
                                    (dict(group=True), "group"),
                                    (dict(_test_ring=2), "_test_ring"),
                                    (dict(group=2, _test_ring=0), "_test_ring"),
                                    (dict(patch=0), "patch"), (dict(patch="wide"), "patch")])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ChainedFFNCompute(**kw)


def test_ffn_package_exports_it():
    import moe_overlap.ffn as ffn
    assert ffn.ChainedFFNCompute is ChainedFFNCompute and "ChainedFFNCompute" in ffn.__all__
