"""Operating the sidecar: counters, latency histograms, the Prometheus collector and its
listener, the readiness rule, log line formats, the sampled access log."""
