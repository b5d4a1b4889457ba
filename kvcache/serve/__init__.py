"""The server side: the RESP server on the Unix socket, its connections and the command layer
(the command table, CLIENT TRACKING, pub/sub, MULTI, SCAN, INFO)."""
