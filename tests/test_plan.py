"""The checkpoint planner (C core through memfit.checkpoint): exact against brute
force, never worse than the classic plans, clear errors. No torch needed."""

import itertools
import math
import random
import time

import numpy as np
import pytest

import memfit
from memfit import checkpoint as mc


def all_plans(n):
    """Every plan of an n-stage chain: each of the n-1 gaps cut or not, each segment
    stored or checkpointed."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        spans = list(zip(bounds[:-1], bounds[1:]))
        for marks in itertools.product((False, True), repeat=len(spans)):
            yield [(s, e, m) for (s, e), m in zip(spans, marks)]


def model_memory(segs, ib, sb):
    ck = [(s, e) for s, e, c in segs if c]
    return (sum(ib[s] for s, e in ck) + sum(sum(sb[s:e]) for s, e, c in segs if not c)
            + max([sum(sb[s:e]) for s, e in ck], default=0))


def model_cost(segs, fc):
    return sum(fc[i] for s, e, c in segs if c for i in range(s, e))


def brute(ib, sb, fc, budgets):
    """(least cost within each budget, least memory of any plan)"""
    costs = [math.inf] * len(budgets)
    least = math.inf
    for segs in all_plans(len(ib)):
        mem = model_memory(segs, ib, sb)
        least = min(least, mem)
        cost = None
        for k, b in enumerate(budgets):
            if mem <= b:
                cost = model_cost(segs, fc) if cost is None else cost
                costs[k] = min(costs[k], cost)
    return costs, least


def test_equals_brute_force_on_random_chains():
    rng = random.Random(5)
    for trial in range(120):
        n = rng.randint(1, 8)
        scale = rng.choice([1, 4096])
        ib = [rng.randint(0, 20) * scale for _ in range(n)]
        sb = [rng.randint(1, 60) * scale for _ in range(n)]
        fc = [rng.choice([rng.randint(1, 9), rng.uniform(0.1, 10.0)]) for _ in range(n)]
        _, least = brute(ib, sb, fc, [])
        assert mc.min_budget(ib, sb) == least
        budgets = sorted(rng.randint(least, sum(sb) + 10 * scale) for _ in range(4))
        wants, _ = brute(ib, sb, fc, budgets)
        for budget, want in zip(budgets, wants):
            p = mc.plan(ib, sb, fc, budget)
            assert p.exact
            assert p.memory_bytes <= budget
            assert p.memory_bytes == model_memory(p.segments, ib, sb)
            assert p.recompute_cost == pytest.approx(model_cost(p.segments, fc), rel=1e-12)
            assert p.recompute_cost == pytest.approx(want, rel=1e-9, abs=1e-12), \
                (ib, sb, fc, budget)
        with pytest.raises(ValueError, match=f"smallest feasible budget for this chain is {least} "):
            mc.plan(ib, sb, fc, least - 1)


def test_segments_cover_the_chain_in_order():
    rng = random.Random(1)
    ib = [rng.randint(1, 9) for _ in range(40)]
    sb = [rng.randint(5, 50) for _ in range(40)]
    p = mc.plan(ib, sb, None, "35%")
    ends = [0] + [e for _, e, _ in p.segments]
    assert [s for s, _, _ in p.segments] == ends[:-1]
    assert ends[-1] == 40 and all(e > s for s, e, _ in p.segments)
    # stored stages are merged into runs: no two stored segments touch
    assert not any(not a[2] and not b[2] for a, b in zip(p.segments, p.segments[1:]))
    assert p.n_stages == 40
    assert p.checkpointed_stages == [i for s, e, c in p.segments if c for i in range(s, e)]


def test_never_worse_than_sqrt_every_stage_or_storing():
    rng = random.Random(2)
    for trial in range(16):
        n = rng.randint(2, 100)
        exact = trial % 2 == 0
        if exact:  # small integers: the DP is exact
            ib = [rng.randint(1, 8) for _ in range(n)]
            sb = [rng.randint(4, 40) for _ in range(n)]
        else:      # arbitrary byte counts: the DP rounds
            ib = [rng.randint(1 << 20, 9 << 20) for _ in range(n)]
            sb = [rng.randint(4 << 20, 80 << 20) for _ in range(n)]
        fc = [rng.uniform(0.5, 2.0) for _ in range(n)]
        sq = mc.plan_sqrt(n, ib, sb, fc)
        p = mc.plan(ib, sb, fc, sq.memory_bytes)
        assert p.recompute_cost <= sq.recompute_cost + 1e-9
        assert p.memory_bytes <= sq.memory_bytes
        every = mc.Plan.from_segments([(i, i + 1, True) for i in range(n)], ib, sb, fc)
        p = mc.plan(ib, sb, fc, every.memory_bytes)
        assert p.recompute_cost <= every.recompute_cost + 1e-9
        if exact:
            assert p.exact
    # a budget of everything stores everything
    p = mc.plan([1, 1, 1], [5, 6, 7], [1, 1, 1], 18)
    assert p.segments == [(0, 3, False)] and p.recompute_cost == 0.0 and p.memory_bytes == 18


def test_1000_stages_plan_quickly():
    rng = random.Random(3)
    n = 1000
    ib = [rng.randint(1 << 20, 16 << 20) for _ in range(n)]
    sb = [rng.randint(4 << 20, 64 << 20) for _ in range(n)]
    fc = [rng.uniform(0.5, 1.5) for _ in range(n)]
    t0 = time.perf_counter()
    p = mc.plan(ib, sb, fc, "25%")
    dt = time.perf_counter() - t0
    print(f"1000 stages planned in {dt:.3f} s ({len(p.segments)} segments)")  # not asserted
    assert p.memory_bytes <= p.budget_bytes
    assert p.memory_bytes == model_memory(p.segments, ib, sb)
    sq = mc.plan_sqrt(n, ib, sb, fc)
    if sq.memory_bytes <= p.budget_bytes:
        assert p.recompute_cost <= sq.recompute_cost
    # identical blocks: exact even at 1000 stages when the budget is a few units
    p = mc.plan([8 << 20] * n, [136 << 20] * n, [1.0] * n, 40 * (136 << 20))
    assert p.memory_bytes <= 40 * (136 << 20)


def test_budget_too_small_says_the_smallest_feasible_budget():
    ib, sb, fc = [10, 10, 10, 10], [100, 100, 100, 100], [1, 1, 1, 1]
    least = mc.min_budget(ib, sb)
    assert least == 140  # every stage checkpointed: 4 * 10 + 100
    with pytest.raises(ValueError, match=r"budget_bytes.*smallest feasible budget.* 140 bytes"):
        mc.plan(ib, sb, fc, 139)
    with pytest.raises(memfit.Error):  # memfit's errors share a base class
        mc.plan(ib, sb, fc, 10)
    p = mc.plan(ib, sb, fc, 140)
    assert p.memory_bytes == 140 and p.recompute_cost == 4.0


@pytest.mark.parametrize("args, exc, pattern", [
    (([1, 2], [1], [1, 1], 10), ValueError, "saved_bytes: expected 2 entries"),
    (([1, 2], [1, 2], [1], 10), ValueError, "forward_cost: expected 2 entries"),
    (([1, -2], [1, 2], [1, 1], 10), ValueError, r"input_bytes\[1\]: must be >= 0"),
    (([1, 2], [1, 2.5], [1, 1], 10), TypeError, r"saved_bytes\[1\]"),
    (([1, 2], [1, 2], [1, float("nan")], 10), ValueError, r"forward_cost\[1\]"),
    (([1, 2], [1, 2], [1, -1], 10), ValueError, r"forward_cost\[1\]"),
    (([], [], [], 10), ValueError, "at least one stage"),
    (([1], [1], [1], -5), ValueError, "budget_bytes: must be >= 0"),
    (([1], [1], [1], "6 parsecs"), ValueError, "budget_bytes: cannot read"),
    (([1], [1], [1], True), TypeError, "budget_bytes"),
    ((5, [1], [1], 10), TypeError, "input_bytes"),
])
def test_argument_errors_name_the_argument(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mc.plan(*args)


def test_parse_bytes():
    assert mc.parse_bytes("6GB") == 6 * 10**9
    assert mc.parse_bytes("6 GiB") == 6 * 2**30
    assert mc.parse_bytes("6G") == 6 * 2**30
    assert mc.parse_bytes("512MiB") == 512 * 2**20
    assert mc.parse_bytes("1.5GB") == 1_500_000_000
    assert mc.parse_bytes("100") == 100
    assert mc.parse_bytes(12345) == 12345
    assert mc.parse_bytes(6e9) == 6_000_000_000
    assert mc.parse_bytes("50%", total=1001) == 500
    with pytest.raises(ValueError, match="share"):
        mc.parse_bytes("50%")
    with pytest.raises(ValueError):
        mc.parse_bytes("-3GB")
    with pytest.raises(ValueError):
        mc.parse_bytes(-1)


def test_plan_sqrt_and_from_segments():
    assert mc.plan_sqrt(12).segments == [(0, 4, True), (4, 8, True), (8, 12, False)]
    assert mc.plan_sqrt(1).segments == [(0, 1, False)]
    assert mc.plan_sqrt(10).segments == [(0, 4, True), (4, 7, True), (7, 10, False)]
    assert mc.plan_sqrt(9).recompute_cost == 6.0 and mc.plan_sqrt(9).memory_bytes is None
    p = mc.plan_sqrt(4, [1, 2, 3, 4], [10, 20, 30, 40], [1, 1, 1, 2])
    # [(0,2,ck), (2,4,stored)]: 1 + (30 + 40) + max(10 + 20)
    assert p.memory_bytes == 101 and p.recompute_cost == 2.0
    with pytest.raises(ValueError, match="n:"):
        mc.plan_sqrt(0)
    with pytest.raises(ValueError, match="segments"):
        mc.Plan.from_segments([(0, 1, True), (2, 3, True)], [1, 1, 1], [1, 1, 1])


def test_plan_prints_what_it_keeps():
    p = mc.plan([2] * 4, [10] * 4, [1] * 4, 34, names=[f"block{i}" for i in range(4)])
    assert p.segments == [(0, 1, True), (1, 2, True), (2, 4, False)]
    text = str(p)
    assert "4 stages in 3 segments, 2 recomputed" in text
    assert "memory 34 B of a 34 B budget (no checkpointing: 40 B)" in text
    assert "recompute cost 2 = 50.0% of one forward" in text
    assert "block0" in text and "checkpointed" in text and "stored" in text
    d = p.to_dict()
    assert d["memory_bytes"] == 34 and d["segments"][2] == [2, 4, False]


def test_rounded_plans_still_fit_and_say_so():
    rng = random.Random(9)
    ib = [rng.randint(10**6, 2 * 10**7) for _ in range(8)]
    sb = [rng.randint(10**7, 9 * 10**7) for _ in range(8)]
    fc = [1.0] * 8
    _, least = brute(ib, sb, fc, [])
    budget = (least + sum(sb)) // 2
    (want,), _ = brute(ib, sb, fc, [budget])
    coarse = mc.plan(ib, sb, fc, budget, max_slots=20)
    assert not coarse.exact and coarse.unit_bytes > 1
    assert coarse.memory_bytes <= budget and coarse.recompute_cost >= want
    assert "rounded" in str(coarse)
    fine = mc.plan(ib, sb, fc, budget, max_slots=4000)
    assert fine.memory_bytes <= budget and want <= fine.recompute_cost <= coarse.recompute_cost




def test_planner_imports_and_plans_without_torch():
    # The planner is meant for machines (and `memfit estimate`) without torch: run it in
    # a fresh interpreter where `import torch` fails, and check the plan it makes.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "from memfit.checkpoint.planner import plan, min_budget\n"
        "import memfit.checkpoint as mc\n"
        "p = plan([10, 10, 10, 10], [100, 100, 100, 100], [1, 1, 1, 1], '140B')\n"
        "print(min_budget([10] * 4, [100] * 4), p.memory_bytes, p.recompute_cost,\n"
        "      mc.parse_bytes('1KiB'), 'torch' in sys.modules and sys.modules['torch'] is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["140", "140", "4.0", "1024", "False"]


# ---- sizes that overflow or make no sense (issue 24 §6) -----------------------------------

@pytest.mark.parametrize("value", ["1e400GB", "1e400", "1e300GB", "1e400%"])
def test_parse_bytes_overflow_is_a_value_error_naming_the_argument(value):
    from memfit.checkpoint import parse_bytes

    with pytest.raises(ValueError, match=r"^budget: '1e[34]00(GB|%)?' (is too large to be a size in bytes|must be a non-negative percentage)"):
        parse_bytes(value, total=10**12)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, -1, "nanGB", "-1GB", "infGB", "inf", np.float32("nan")])
def test_parse_bytes_refuses_nan_inf_and_negative_sizes(value):
    from memfit.checkpoint import parse_bytes

    with pytest.raises(ValueError, match=r"^budget: "):
        parse_bytes(value)


def test_parse_bytes_takes_numpy_floats():
    from memfit.checkpoint import parse_bytes

    assert parse_bytes(np.float32(1024.0)) == 1024 and parse_bytes(np.float64(2.5e9)) == 2_500_000_000


@pytest.mark.parametrize("budget", ["1e400GB", float("nan"), -5, "-1GB"])
def test_auto_names_a_bad_budget_before_touching_the_model(budget):
    torch = pytest.importorskip("torch")
    import memfit.checkpoint as mc

    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    with pytest.raises(ValueError, match=r"^budget: "):
        mc.auto(net, torch.randn(2, 4), budget=budget)
    assert all("forward" not in b.__dict__ for b in net)


@pytest.mark.parametrize("budget", [2**63 - 1, 2**63, 2**64, 10**30, "1e30GB", 1e30,
                                    np.float64(2.0**70)])
def test_budget_beyond_int64_means_no_limit(budget):
    # issue 31 §1: no chain's memory reaches 2**63 bytes; the core gets the largest
    # budget it can take and the Plan keeps the one given
    from memfit.checkpoint import parse_bytes

    p = mc.plan([2, 2, 2, 2], [10, 10, 10, 10], [1, 1, 1, 1], budget)
    assert p.segments == [(0, 4, False)] and p.memory_bytes == 40 and p.recompute_cost == 0.0
    assert p.budget_bytes == parse_bytes(budget) >= 2**63 - 1
    assert "budget" in str(p)


@pytest.mark.parametrize("slots", [2**63, 2**64, 10**30])
def test_huge_max_slots_is_clamped(slots):
    # more slots than budget bytes add nothing: same plan as the exact default
    assert mc.plan([2, 2, 2, 2], [10, 10, 10, 10], None, "85%", max_slots=slots).segments == \
        mc.plan([2, 2, 2, 2], [10, 10, 10, 10], None, "85%").segments


@pytest.mark.parametrize("slots, err", [(-1, ValueError), (1.5, TypeError), (True, TypeError),
                                        ("8", TypeError)])
def test_bad_max_slots_refused(slots, err):
    with pytest.raises(err, match="max_slots"):
        mc.plan([2, 2], [10, 10], None, "85%", max_slots=slots)


@pytest.mark.parametrize("segs", [[(0, 2**63, True)], [(-2**70, 2, True)], [(0, 5, False)]])
def test_from_segments_out_of_range_refused(segs):
    with pytest.raises(ValueError, match=r"segments\[0\]"):
        mc.Plan.from_segments(segs, [4, 4], [10, 10])
