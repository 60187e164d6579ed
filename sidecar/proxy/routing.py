"""Replica state and routing policies. Pure: no I/O, so every policy has exact tests.

Policies pick among the *healthy* replicas (all of them when none is healthy: a proxy that
refuses everything because its health view is stale is worse than one that tries).

- least_outstanding: fewest requests in flight; ties broken round-robin so equal replicas share.
- round_robin: in turn.
- session: rendezvous (highest-random-weight) hashing of the session key, so a session sticks to
  one replica and only the sessions of a replica that leaves move. No key -> least_outstanding.
- prefix: rendezvous hashing of the prompt's first block, so requests that share a prefix land
  where that prefix is cached. No prompt -> least_outstanding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from sidecar.config import RoutePolicy
from sidecar.engine_metrics import EngineView


@dataclass(slots=True, eq=False)
class Replica:
    """One upstream and what the proxy knows of it (mutable, owned by the event loop)."""

    url: str
    index: int
    outstanding: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    ejections: int = 0
    requests_total: int = 0
    engine: EngineView = field(default_factory=EngineView)
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.label = self.url.split("://", 1)[-1]

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.healthy = True

    def record_failure(self, eject_after: int) -> bool:
        """Count a failure; returns True if this failure ejected the replica."""
        self.consecutive_failures += 1
        if self.healthy and self.consecutive_failures >= eject_after:
            self.healthy = False
            self.ejections += 1
            return True
        return False


def _weight(key: bytes, replica: Replica) -> bytes:
    return hashlib.blake2b(key + b"\x00" + replica.url.encode(), digest_size=8).digest()


def rendezvous(key: bytes, candidates: Sequence[Replica]) -> Replica:
    return max(candidates, key=lambda replica: _weight(key, replica))


# The policy as a small int, tested per request: a member of an Enum read off its class is an
# attribute lookup through the enum's metaclass each time (~45 ns, three per choice).
_LEAST_OUTSTANDING: Final = 0
_ROUND_ROBIN: Final = 1
_SESSION: Final = 2
_PREFIX: Final = 3


def _policy_code(policy: RoutePolicy) -> int:
    if policy is RoutePolicy.ROUND_ROBIN:
        return _ROUND_ROBIN
    if policy is RoutePolicy.SESSION:
        return _SESSION
    if policy is RoutePolicy.PREFIX:
        return _PREFIX
    return _LEAST_OUTSTANDING


class Router:
    def __init__(self, replicas: Sequence[Replica], policy: RoutePolicy) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self._policy = policy
        self._code = _policy_code(policy)
        self._turn = 0

    @property
    def policy(self) -> RoutePolicy:
        return self._policy

    def candidates(self, exclude: Sequence[Replica] = ()) -> list[Replica]:
        pool = [r for r in self.replicas if r not in exclude]
        healthy = [r for r in pool if r.healthy]
        return healthy or pool

    def choose(
        self,
        *,
        session_key: str | None = None,
        prefix_key: bytes | None = None,
        exclude: Sequence[Replica] = (),
    ) -> Replica | None:
        pool = self.candidates(exclude)
        if not pool:
            return None
        code = self._code
        if code == _ROUND_ROBIN:
            return self._next_in_turn(pool)
        if code == _SESSION and session_key:
            return rendezvous(session_key.encode(), pool)
        if code == _PREFIX and prefix_key:
            return rendezvous(prefix_key, pool)
        # A loop, not min() over a generator: compiled, the generator object was a third of
        # a choice's cost (350 -> 253 ns at one replica, timeit; RESULTS.md "Session 27").
        least = pool[0].outstanding
        for replica in pool:
            if replica.outstanding < least:
                least = replica.outstanding
        return self._next_in_turn([r for r in pool if r.outstanding == least])

    def _next_in_turn(self, pool: list[Replica]) -> Replica:
        # Walk the global turn counter so that ties rotate over the full replica list order.
        self._turn += 1
        return pool[self._turn % len(pool)]
