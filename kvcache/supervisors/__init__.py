"""Processes beside the sidecar's own: `workers = N` (workers.py starts and replaces them,
worker.py is one, board.py is what they share with the feed's process)."""
