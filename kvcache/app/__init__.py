"""The application's side: what a program imports to read the sidecar's data. The socket
clients (`client`) and the in-process replica reader (`reader`, with `get`, the twin of
ext/app_get.pyx). It imports nothing of the server, read or feed side (tests/test_layout.py)."""
