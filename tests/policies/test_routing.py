"""Routing policies: plain choices over candidate snapshots, deterministic given their injected randomness."""

from __future__ import annotations

import random
from collections import Counter
from typing import get_args

import pytest

from policies.routing import (
    POLICY_NAMES,
    Candidate,
    ConsistentHash,
    LeastOutstanding,
    PowerOfTwo,
    RoundRobin,
    make_policy,
)
from registry.fields import Routing


def candidates(*outstanding: int) -> list[Candidate]:
    return [Candidate(f"m/{i}", n) for i, n in enumerate(outstanding)]


def test_round_robin_cycles_through_every_candidate_in_order():
    policy = RoundRobin()
    picks = [policy.choose(candidates(5, 0, 9)).replica_id for _ in range(6)]
    assert picks == ["m/0", "m/1", "m/2", "m/0", "m/1", "m/2"]  # load is ignored


def test_round_robin_copes_with_the_candidate_list_shrinking():
    policy = RoundRobin()
    policy.choose(candidates(0, 0, 0))
    policy.choose(candidates(0, 0, 0))
    assert policy.choose(candidates(0, 0)).replica_id in {"m/0", "m/1"}  # no IndexError after a replica left


def test_least_outstanding_picks_the_least_loaded():
    policy = LeastOutstanding()
    assert {policy.choose(candidates(3, 1, 2)).replica_id for _ in range(5)} == {"m/1"}


def test_least_outstanding_spreads_ties_evenly():
    policy = LeastOutstanding()
    picks = Counter(policy.choose(candidates(0, 4, 0, 0)).replica_id for _ in range(30))
    assert picks == {"m/0": 10, "m/2": 10, "m/3": 10}  # the loaded one never, the tied ones in turn


def test_power_of_two_with_two_candidates_always_takes_the_less_loaded():
    policy = PowerOfTwo(random.Random(0))
    assert {policy.choose(candidates(7, 2)).replica_id for _ in range(20)} == {"m/1"}


def test_power_of_two_never_picks_the_most_loaded_and_favours_the_least():
    policy = PowerOfTwo(random.Random(1234))
    picks = Counter(policy.choose(candidates(0, 5, 9)).replica_id for _ in range(300))
    assert "m/2" not in picks  # it loses to whichever it is paired with
    # the least loaded wins 2 of the 3 possible pairs, the middle one only 1
    assert picks["m/0"] > picks["m/1"] > 0


def test_power_of_two_is_deterministic_for_a_seed():
    def run(seed: int) -> list[str]:
        policy = PowerOfTwo(random.Random(seed))
        return [policy.choose(candidates(1, 1, 1, 1)).replica_id for _ in range(20)]

    assert run(7) == run(7)
    assert len(set(run(7))) > 1  # equal loads: random pairs, not always the same replica


def test_power_of_two_with_one_candidate_returns_it():
    only = Candidate("m/0", 3)
    assert PowerOfTwo(random.Random(0)).choose([only]) is only


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_make_policy_builds_each_known_policy_fresh(name):
    first, second = make_policy(name), make_policy(name)
    assert first is not second  # each instance group gets its own round-robin / tie-break state
    assert first.choose(candidates(0)).replica_id == "m/0"


def test_make_policy_unknown_name_names_the_options():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'") as err:
        make_policy("fastest")
    for name in ("least_outstanding", "power_of_two", "round_robin"):
        assert name in str(err.value)


def test_the_registry_offers_exactly_the_known_policies():
    assert set(get_args(Routing)) == set(POLICY_NAMES)


def _keys(count: int) -> list[str]:
    return [f"document {i}: the shared system prompt and retrieved passages" for i in range(count)]


def test_consistent_hash_sends_a_key_to_the_same_replica_every_time():
    policy = ConsistentHash()
    first = [policy.choose(candidates(0, 0, 0, 0), key).replica_id for key in _keys(200)]
    again = [ConsistentHash().choose(candidates(0, 0, 0, 0), key).replica_id for key in _keys(200)]
    assert first == again  # stable across instances (and processes: blake2b, not the salted hash())
    spread = Counter(first)
    assert set(spread) == {"m/0", "m/1", "m/2", "m/3"} and min(spread.values()) > 200 / 4 * 0.5


def test_consistent_hash_moves_only_the_keys_of_a_replica_that_left():
    policy = ConsistentHash()
    before = {key: policy.choose(candidates(0, 0, 0, 0), key).replica_id for key in _keys(300)}
    three = [c for c in candidates(0, 0, 0, 0) if c.replica_id != "m/2"]
    after = {key: policy.choose(three, key).replica_id for key in _keys(300)}
    moved = [key for key in before if before[key] != after[key]]
    assert moved and all(before[key] == "m/2" for key in moved)


def test_consistent_hash_bounds_the_load_of_a_hot_key():
    policy = ConsistentHash(load_bound=1.25)
    loads = dict.fromkeys(["m/0", "m/1", "m/2", "m/3"], 0)
    for _ in range(40):  # one key, requests that stay in flight
        pick = policy.choose([Candidate(rid, n) for rid, n in loads.items()], "hot")
        loads[pick.replica_id] += 1
        total = sum(loads.values())
        assert max(loads.values()) <= -(-1.25 * total // 4)  # ceil(1.25 x mean) at every step
    home = ConsistentHash().choose(candidates(0, 0, 0, 0), "hot").replica_id
    assert loads[home] == max(loads.values())  # the key's own replica still takes the largest part


def test_consistent_hash_without_a_key_is_least_outstanding():
    assert ConsistentHash().choose(candidates(3, 1, 2)).replica_id == "m/1"
