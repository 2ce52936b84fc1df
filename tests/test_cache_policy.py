"""Property tests of the ClassLRU policy and the CPU share on random routing."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moechat.engine.cache.policy import (
    N_CLASS,
    POLICIES,
    SECOND_USE_WINDOW,
    SHARE_ONE,
    UPLOAD_CAP,
    CachePolicyError,
    ClassLRU,
    CpuShare,
)
from testkit.policy_ref import RefClassLRU


def check_consistent(p: ClassLRU) -> None:
    owners = {}
    for layer, slots in p.slot_map.items():
        for e, s in enumerate(slots):
            if s >= 0:
                assert p.key_of[s] == p.key(layer, e), "slot map and slot owner disagree"
                assert s not in owners, "a slot holds two experts"
                owners[s] = (layer, e)
    filled = [s for s in range(p.n_slots) if p.key_of[s] >= 0]
    assert len(filled) == len(owners) == p.n_filled
    # Every slot is in exactly one class list, and knows which.
    seen = []
    for c in range(N_CLASS):
        for s in p.lists[c]:
            assert p.list_of[s] == c
            seen.append(s)
    assert sorted(seen) == list(range(p.n_slots))


routing = st.tuples(
    st.integers(4, 24),  # experts per layer
    st.integers(1, 4),  # experts used per token
    st.integers(1, 3),  # layers
    st.integers(0, 2**31 - 1),  # seed
    st.sampled_from([0.0, 0.3, 0.5, 0.95, 1.0]),
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None)
@given(routing)
def test_policy_invariants_on_random_routing(policy: str, args: tuple[int, int, int, int, float]) -> None:
    n_expert, k, n_layers, seed, share = args
    rng = random.Random(seed)
    layers = list(range(n_layers))
    n_slots = rng.randint(k, n_expert * n_layers)
    p = ClassLRU(layers, n_expert, n_slots, policy)
    cpu_share = CpuShare(share)
    last_use: dict[tuple[int, int], int] = {}  # (layer, expert) -> the layer's clock at its last use
    hot = [rng.sample(range(n_expert), k) for _ in layers]  # skewed routing: a hot set per layer
    for _ in range(120):
        for layer in layers:
            n_tokens = rng.choice([1, 1, 1, 2, 4])
            ids = []
            for _ in range(n_tokens):
                pool = hot[layer] if rng.random() < 0.7 else list(range(n_expert))
                ids += rng.sample(pool, k) if len(pool) >= k else rng.sample(range(n_expert), k)
            if len(set(ids)) > n_slots:
                with pytest.raises(CachePolicyError, match="distinct experts"):
                    p.plan(layer, ids, n_tokens)
                continue
            was_full = p.full
            owners = list(p.key_of)
            owner_crf = [p.decayed(key) if key >= 0 else 0.0 for key in owners]
            now = p.clock[layer]
            plan = p.plan(layer, ids, n_tokens, cpu_share.active())
            if plan.cpu:
                assert was_full, "the CPU share or the policy refused a miss before the group was full"
            if was_full and policy == "upload-cap":
                assert len(plan.uploads) <= UPLOAD_CAP * n_tokens
            for e, s in plan.uploads:
                if was_full and policy == "second-use":
                    assert now - last_use.get((layer, e), -(10**9)) <= SECOND_USE_WINDOW, "admitted on first use"
                if was_full and policy == "protect" and owners[s] >= 0:
                    assert p.crf[p.key(layer, e)] >= owner_crf[s], "evicted an expert used more than the newcomer"
            for e in set(ids):
                last_use[(layer, e)] = now
            uniq = set(ids)
            assert set(plan.hits) | {e for e, _ in plan.uploads} | set(plan.cpu) == uniq
            assert len(plan.hits) + len(plan.uploads) + len(plan.cpu) == len(uniq)
            for e, s in plan.uploads:
                assert p.slot_of(layer, e) == s
            for e in plan.cpu:
                assert p.slot_of(layer, e) == -1
            assert [e for e, _ in plan.uploads] == sorted(e for e, _ in plan.uploads)
            check_consistent(p)


def test_cpu_share_is_exact_on_average() -> None:
    rng = random.Random(0)
    for share in (0.0, 0.1, 0.5, 0.77, 0.95, 1.0):
        cs = CpuShare(share)
        total = taken = 0
        for i in range(5000):
            n = rng.randint(0, 8)
            t = cs.take(i % 3, n)
            assert 0 <= t <= n
            total, taken = total + n, taken + t
        q = round(share * SHARE_ONE)
        # The carry keeps the long-run count within one miss per layer of q/65536 of the misses.
        assert abs(taken - total * q / SHARE_ONE) <= 3
        assert abs(q / SHARE_ONE - share) <= 1 / SHARE_ONE
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        CpuShare(1.5)


def test_victim_rule_prefers_old_and_rarely_used() -> None:
    p = ClassLRU([0], n_expert=8, n_slots=3)
    p.plan(0, [0], 1)
    for _ in range(40):  # expert 1 used often: high class
        p.plan(0, [1], 1)
    p.plan(0, [2], 1)  # slots full: 0 (old, rare), 1 (frequent), 2 (recent, rare)
    plan = p.plan(0, [3], 1)
    assert plan.evicted == ((0, 0),)  # the oldest rare expert goes
    plan = p.plan(0, [4], 1)
    assert plan.evicted == ((0, 2),)  # age/2^class: the rare one, not the frequent one
    assert p.slot_of(0, 1) >= 0


def test_misses_fill_consecutive_slots_in_expert_order() -> None:
    p = ClassLRU([0], n_expert=16, n_slots=8)
    plan = p.plan(0, [7, 3, 5, 4], 1)
    assert plan.uploads == ((3, 0), (4, 1), (5, 2), (7, 3))


def test_lowest_crf_misses_go_to_the_cpu() -> None:
    p = ClassLRU([0], n_expert=8, n_slots=2)
    p.plan(0, [0, 1], 1)  # full
    for _ in range(5):
        p.plan(0, [0, 1], 1)
    p.plan(0, [0, 2], 1)
    p.plan(0, [0, 2], 1)  # 2 has some CRF now, 3 none
    plan = p.plan(0, [2, 3], 1, CpuShare(1.0))  # 2 hits; its one miss goes to the CPU
    assert plan.cpu == (3,)


@settings(max_examples=40, deadline=None)
@given(routing)
def test_fast_policy_matches_the_literal_reference(args: tuple[int, int, int, int, float]) -> None:
    """The engine's policy (OrderedDicts, decay table) decides exactly what the rules say, lookup by lookup."""
    n_expert, k, n_layers, seed, share = args
    rng = random.Random(seed)
    layers = list(range(n_layers))
    n_slots = rng.randint(k * 2 if k * 2 <= n_expert * n_layers else k, n_expert * n_layers)
    fast, ref = ClassLRU(layers, n_expert, n_slots), RefClassLRU(layers, n_expert, n_slots)
    share_fast, share_ref = CpuShare(share), CpuShare(share)
    hot = [rng.sample(range(n_expert), k) for _ in layers]
    for step in range(150):
        layer = step % n_layers
        n_tokens = rng.choice([1, 1, 1, 2])
        ids: list[int] = []
        for _ in range(n_tokens):
            pool = hot[layer] if rng.random() < 0.6 else list(range(n_expert))
            ids += rng.sample(pool, k)
        if len(set(ids)) > n_slots:
            continue
        plan = fast.plan(layer, ids, n_tokens, share_fast.active())
        want = ref.plan(layer, ids, n_tokens, functools.partial(share_ref.take, layer) if share_ref.q else None)
        assert (plan.hits, plan.uploads, plan.cpu) == want, f"step {step}"


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "classlru"])
def test_each_policy_refuses_some_misses_that_classlru_admits(policy: str) -> None:
    """On skewed routing with a full cache each policy keeps some misses out of the slots (so the
    variants are not ClassLRU under another name), and only those go to the CPU."""
    rng = random.Random(1)
    base, other = ClassLRU([0], 32, 8), ClassLRU([0], 32, 8, policy)
    refused = 0
    for _ in range(600):
        ids = rng.sample(range(8), 2) + rng.sample(range(32), 2)
        ids = list(dict.fromkeys(ids))
        a, b = base.plan(0, ids, 1), other.plan(0, ids, 1)
        assert not a.cpu
        refused += len(b.cpu)
        assert set(b.hits) | {e for e, _ in b.uploads} | set(b.cpu) == set(ids)
    assert refused > 0


@settings(max_examples=40, deadline=None)
@given(routing)
def test_prefetch_keeps_the_slots_consistent_and_its_right_guesses_become_hits(
    args: tuple[int, int, int, int, float],
) -> None:
    n_expert, k, n_layers, seed, share = args
    rng = random.Random(seed)
    layers = list(range(n_layers))
    n_slots = rng.randint(k, n_expert * n_layers)
    p = ClassLRU(layers, n_expert, n_slots)
    cpu_share = CpuShare(share)
    for _ in range(80):
        for layer in layers:
            ids = rng.sample(range(n_expert), k)
            guess = ids[: rng.randint(0, k)] + rng.sample(range(n_expert), rng.randint(0, 2))
            cached_before = {e for e in range(n_expert) if p.slot_of(layer, e) >= 0}
            crf_before = list(p.crf)
            uploads = p.prefetch(layer, guess)
            check_consistent(p)
            assert list(p.crf) == crf_before  # a prediction is not a use
            assert {e for e, _ in uploads} <= set(guess) - cached_before  # only what was not there
            if len(set(guess)) <= n_slots:
                assert {e for e, _ in uploads} == set(guess) - cached_before
                assert all(p.slot_of(layer, e) >= 0 for e in guess)
            # Slots filled by a prefetch (this one or an earlier one) whose expert is still unused.
            waiting = {e for e in set(ids) if p.slot_of(layer, e) in p.prefetched}
            plan = p.plan(layer, ids, 1, cpu_share.active())
            assert plan.prefetched_hits == len(waiting)  # each right guess is a hit, counted once
            assert set(plan.hits) >= {e for e, _ in uploads} & set(ids)
            assert not {p.slot_of(layer, e) for e in ids} & p.prefetched  # used: no longer waiting
            check_consistent(p)


@pytest.mark.parametrize("admission", POLICIES)
@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([4, 8, 16, 64, 256]),  # experts per layer
    st.sampled_from([1, 2, 4, 8]),  # experts per token
    st.floats(0.0, 1.0),  # slots, as a fraction of the experts
    st.sampled_from([0.0, 0.3, 0.5, 0.95]),  # CPU share
    st.integers(0, 2**16),  # routing seed
)
def test_the_compiled_policy_plans_exactly_as_the_python_one(
    admission: str, n_expert: int, k: int, frac: float, share: float, seed: int
) -> None:
    """The compiled per-lookup steps (lru_core) against ClassLRU as it was written in Python: the same
    plan for every lookup (hits, uploads with their slots, CPU misses, evictions, prefetched hits) and
    the same prefetches, warm start, CRFs and class lists, on skewed routing of 1 to 4 tokens."""
    from testkit.classlru_py import ClassLRU as PythonClassLRU

    rng = random.Random(seed)
    k = min(k, n_expert)
    layers = [0, 2, 3]
    n_slots = max(k, int(frac * len(layers) * n_expert))
    fast, ref = ClassLRU(layers, n_expert, n_slots, admission), PythonClassLRU(layers, n_expert, n_slots, admission)
    warm = [(layer, e, rng.uniform(1, 40)) for layer in layers for e in rng.sample(range(n_expert), min(3, n_expert))]
    assert fast.preload(warm) == ref.preload(warm)
    share_fast, share_ref = CpuShare(share), CpuShare(share)
    weights = [1 / (i + 1) ** 1.1 for i in range(n_expert)]
    last: tuple[int, list[int]] | None = None
    for step in range(300):
        layer = layers[step % 3]
        n_tokens = rng.choice([1, 1, 1, 2, 4])
        ids: list[int] = []
        for _ in range(n_tokens):
            chosen: set[int] = set()
            while len(chosen) < k:
                chosen.add(rng.choices(range(n_expert), weights)[0])
            ids += rng.sample(sorted(chosen), k)
        if len(set(ids)) > n_slots:
            with pytest.raises(CachePolicyError):
                fast.plan(layer, ids, n_tokens, share_fast.active())
            continue
        if rng.random() < 0.2:
            guess = [*ids[:k], rng.randrange(n_expert)]
            # Half the time sparing the lookup just made (the engine's prefetch after a lookup).
            spare = last if rng.random() < 0.5 else None
            held = [] if spare is None else [(e, fast.slot_of(spare[0], e)) for e in spare[1]]
            assert fast.prefetch(layer, guess, spare) == ref.prefetch(layer, guess, spare)
            if spare is not None:  # what the lookup just made holds stays where it is
                assert all(fast.slot_of(spare[0], e) == s for e, s in held if s >= 0)
        got = fast.plan(layer, ids, n_tokens, share_fast.active())
        want = ref.plan(layer, ids, n_tokens, share_ref.active())
        assert tuple(got) == tuple(want), (step, layer, ids)
        last = (layer, list(dict.fromkeys(ids)))
    assert list(fast.crf) == ref.crf and list(fast.last_use) == ref.last_use and list(fast.clock) == ref.clock
    assert fast.lists == [list(lst) for lst in ref.lists] and fast.prefetched == ref.prefetched
    assert fast.decayed_crf(layers[0]) == ref.decayed_crf(layers[0])
