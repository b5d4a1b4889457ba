"""Compiled extensions, built by setup.py from ext/*.pyx; kvcache/native.py chooses them."""
