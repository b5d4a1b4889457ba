"""What the tests share, apart from the test modules: real servers and sidecar processes
(topology, sidecar_proc, natsauth), the checkers that judge reads (checkers), wire vectors
(nats_vectors, resp_vectors), a proxy that loses core messages (lossy_proxy), data helpers
(kvdata, access_records), processes (procs) and the one poller (poll.wait_until). No test module imports
another; they import from here."""
