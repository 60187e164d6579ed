"""`GET /metrics` on the traffic port, in front of several replicas.

Benchmark clients (and people) scrape ``<base_url>/metrics`` to read the server's own metrics
beside their load. Through a gateway in front of N replicas, relaying that to one replica chosen
like a generation request would answer from a different replica each time, and the numbers
would silently mix. So the sidecar answers it itself: every replica's exposition, each sample
labelled ``replica="<host:port>"`` (as the sidecar's own metrics label it), one family with its
HELP and TYPE once. A replica that does not answer is left out and named in a comment line.
With one replica the request is relayed as it is (a sidecar in the replica's pod is
transparent). ``HEAD`` gets the headers of the ``GET`` answer, without its body.

Pure: text in, text out; the proxy does the fetching (relay.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

REPLICA_LABEL = "replica"
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Merged(Collector):
    def __init__(self, families: dict[str, Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families.values()


def merge_expositions(
    expositions: Sequence[tuple[str, str]], failed: Sequence[tuple[str, str]] = ()
) -> bytes:
    """One exposition of ``(replica label, text)`` pairs: every sample gets the replica label
    (an existing ``replica`` label is kept and the upstream's renamed ``exported_replica``, as
    Prometheus does with target labels). ``failed``: (replica, why) pairs, listed in a comment.
    Raises ValueError when a text cannot be parsed."""
    families: dict[str, Metric] = {}
    for replica, text in expositions:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            elif merged.type != family.type:
                raise ValueError(
                    f"metric {family.name} is a {merged.type} on one replica and a "
                    f"{family.type} on {replica}"
                )
            for sample in family.samples:
                labels = dict(sample.labels)
                if REPLICA_LABEL in labels:
                    labels["exported_" + REPLICA_LABEL] = labels.pop(REPLICA_LABEL)
                labels[REPLICA_LABEL] = replica
                merged.add_sample(
                    sample.name, labels, sample.value, sample.timestamp, sample.exemplar
                )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families))
    body = generate_latest(registry)
    if failed:
        notes = "".join(f"# replica {replica} not included: {why}\n" for replica, why in failed)
        body = notes.encode() + body
    return body
