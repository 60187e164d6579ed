"""The measuring reverse proxy: relay, stamp, route, and hand one record per request to sinks."""
