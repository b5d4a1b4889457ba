# The two commands a new user needs (README.md): `make demo` and `make test`.
# Both install what they need into the current Python environment first.
PYTHON ?= python3
PYTEST_ARGS ?=

.PHONY: demo test install install-test native-deps system-deps bench clean

APT = if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $(1) >/dev/null; \
      else sudo apt-get update -qq && sudo apt-get install -y -qq $(1) >/dev/null; fi

install: native-deps
	$(PYTHON) -m pip install -q -e .

install-test: native-deps
	$(PYTHON) -m pip install -q -e ".[test]"

# liblmdb-dev: the server's native GET path links the system LMDB (ext/getpath.pyx). Without
# it that one extension is not built and its pure-Python twin serves, so a failure here is
# only a warning.
native-deps:
	@if [ ! -e /usr/include/lmdb.h ] && command -v apt-get >/dev/null; then \
	  $(call APT,liblmdb-dev) || echo "warning: liblmdb-dev not installed; the GET path runs in Python"; \
	fi

# redis-server/redis-cli/redis-benchmark are third-party peers in the tests (Debian packages).
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then \
	  $(call APT,redis-server redis-tools); \
	fi

# The sidecar on an embedded nats-server with a demo bucket; Ctrl-C stops it.
demo: install
	$(PYTHON) -m kvcache serve --data-dir ./kvcache-data

test: system-deps install-test
	$(PYTHON) -m ruff check kvcache tests bench
	$(PYTHON) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
	# the socket path once more on the pure-Python twins of the native readers
	KVCACHE_NO_EXTENSIONS=1 $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_server.py tests/test_commands.py tests/test_client.py tests/test_hostile.py

clean:
	rm -rf build dist *.egg-info kvcache-data ext/*.c kvcache/*.so
