"""The read side: where a read is answered (`policy`), every read carried out (`reads`), and
fallback reads across peers (`router`, `peer`, `peerset`)."""
