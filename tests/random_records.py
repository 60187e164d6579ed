"""Random but well-formed records for equivalence tests: failures, missing server sides,
streams with no token event, multi-token and zero-token events, n > 1 (interleaved choices),
unknown N_out, missing ends,
SLO classes known and unknown, engine timings present or not, other endpoints."""

from __future__ import annotations

import random

from sidecar.record import EngineTiming, Int64s, Outcome, RequestRecord, Timeline


def random_records(
    seed: int,
    n: int,
    start_wall_ns: int = 10**18,
    tokens_per_event: tuple[int, ...] = (1, 1, 1, 2, 5, 0),
) -> list[RequestRecord]:
    """``tokens_per_event``: what each event's token count is drawn from ((1,): one token per
    chunk, as vLLM streams by default)."""
    rng = random.Random(seed)
    out = []

    def timeline(start: int) -> Timeline:
        events = rng.choice([0, 0, 1, 2, 3, rng.randint(4, 40)])
        at = start + rng.randint(0, 10**9)
        offsets, tokens = [], []
        for _ in range(events):
            at += rng.randint(0, 50_000_000)
            offsets.append(at)
            tokens.append(rng.choice(tokens_per_event))
        end = None if rng.random() < 0.2 else at + rng.randint(0, 10**6)
        # n > 1 for a fifth of them: interleaved choices, one choice column per event.
        n = rng.choice([1, 1, 1, 1, 2, 3])
        choices = Int64s(rng.randrange(n) for _ in offsets) if n > 1 else None
        return Timeline(
            start_ns=start,
            offsets_ns=Int64s(offsets),
            tokens=Int64s(tokens),
            end_ns=end,
            choices=choices,
        )

    for i in range(n):
        server = None if rng.random() < 0.2 else timeline(rng.randint(0, 10**7))
        engine = (
            None
            if rng.random() < 0.5
            else EngineTiming(
                time_to_first_token_ms=rng.choice([None, rng.random() * 100]),
                queue_time_ms=rng.random() * 10,
                mean_itl_ms=rng.choice([None, rng.random()]),
                generation_time_ms=rng.random() * 1000,
            )
        )
        out.append(
            RequestRecord(
                request_id=rng.choice(["run-a-", "run-b-"]) + str(i),
                wall_time_ns=start_wall_ns + i * 1_000_000,
                endpoint=rng.choice(["chat", "chat", "completions", "/v1/models"]),
                outcome=rng.choice([Outcome.OK] * 6 + [Outcome.TIMEOUT, Outcome.HTTP_ERROR]),
                client=timeline(0),
                server=server,
                engine=engine,
                n_in=rng.choice([None, rng.randint(1, 500)]),
                n_out=None if rng.random() < 0.3 else rng.randint(0, 60),
                attributes={"slo_class": rng.choice(["a", "b", "zzz"])},
                request_read_ns=rng.choice([None, rng.randint(0, 10**6)]),
            )
        )
    return out
