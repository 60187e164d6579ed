from __future__ import annotations

from sidecar.config import RoutePolicy
from sidecar.proxy.routing import Replica, Router


def replicas(n: int) -> list[Replica]:
    return [Replica(f"http://127.0.0.1:{8100 + i}", i) for i in range(n)]


def test_least_outstanding_picks_the_idlest_and_rotates_ties() -> None:
    pool = replicas(3)
    router = Router(pool, RoutePolicy.LEAST_OUTSTANDING)
    pool[0].outstanding, pool[1].outstanding, pool[2].outstanding = 3, 1, 1
    picks = [router.choose() for _ in range(4)]
    assert set(picks) == {pool[1], pool[2]}
    assert picks[0] is not picks[1]  # ties alternate
    pool[2].outstanding = 0
    assert router.choose() is pool[2]


def test_round_robin_visits_every_replica_in_turn() -> None:
    pool = replicas(3)
    router = Router(pool, RoutePolicy.ROUND_ROBIN)
    picks = [router.choose() for _ in range(6)]
    assert picks[:3] == picks[3:] and set(picks) == set(pool)


def test_session_affinity_is_sticky_and_moves_only_the_lost_replicas_sessions() -> None:
    pool = replicas(4)
    router = Router(pool, RoutePolicy.SESSION)
    keys = [f"user-{i}" for i in range(200)]
    before = {k: router.choose(session_key=k) for k in keys}
    assert all(router.choose(session_key=k) is before[k] for k in keys)
    assert len(set(before.values())) == 4  # spread over all replicas
    pool[1].healthy = False
    after = {k: router.choose(session_key=k) for k in keys}
    moved = [k for k in keys if after[k] is not before[k]]
    assert moved and all(before[k] is pool[1] for k in moved)
    # No key: falls back to least outstanding.
    pool[0].outstanding = 5
    assert router.choose(session_key=None) is not pool[0]


def test_prefix_affinity_groups_shared_prefixes() -> None:
    router = Router(replicas(3), RoutePolicy.PREFIX)
    a = router.choose(prefix_key=b"system: you are a helpful assistant")
    assert all(
        router.choose(prefix_key=b"system: you are a helpful assistant") is a for _ in range(5)
    )


def test_unhealthy_replicas_are_skipped_unless_all_are_down() -> None:
    pool = replicas(2)
    router = Router(pool, RoutePolicy.ROUND_ROBIN)
    pool[0].healthy = False
    assert all(router.choose() is pool[1] for _ in range(3))
    pool[1].healthy = False
    assert router.choose() in pool  # trying beats refusing on a stale health view
    assert router.choose(exclude=pool) is None


def test_ejection_after_consecutive_failures_and_recovery() -> None:
    replica = replicas(1)[0]
    assert not replica.record_failure(eject_after=2)
    assert replica.healthy
    assert replica.record_failure(eject_after=2)
    assert not replica.healthy and replica.ejections == 1
    assert not replica.record_failure(eject_after=2)  # already out: not ejected twice
    replica.record_success()
    assert replica.healthy and replica.consecutive_failures == 0
