"""Record sinks: where finished RequestRecords go (live window, Prometheus, OTel, capture)."""
