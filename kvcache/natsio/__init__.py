"""NATS: the connections (with kvcache's protocol reader) and the sidecar's care of them
(upstream.py), the JetStream API requests, and the nats-server processes (embedded mode,
supervised by embedded.py, and the test topologies)."""
