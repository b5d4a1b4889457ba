"""NATS: the connections (with kvcache's protocol reader), the JetStream API requests, and the
nats-server processes (embedded mode and the test topologies)."""
