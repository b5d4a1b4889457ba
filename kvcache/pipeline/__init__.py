"""PySpark jobs around the sidecar: `kvcache load` (materialize a dataset into a KV bucket) and
`kvcache hotkeys` (analyse sampled access logs).

The modules that run on Spark executors (`keys`, `writer`) import only the standard library,
nats-py and pyarrow, so shipping the package with `--py-files` is enough for a cluster
(see `bundle`). Everything that imports pyspark does so inside functions: `kvcache serve`
never loads it.
"""
