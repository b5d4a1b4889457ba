# The two commands a new user needs (README.md): `make demo` and `make test`.
# Both install what they need first, into a virtualenv: the one already active (VIRTUAL_ENV
# set), or else this project's own ./.venv, made here with $(HOST_PYTHON) -m venv (so a pyenv,
# conda or system python3 shared with other projects is left alone). PYTHON=... chooses the
# interpreter outright (and installs into it). The install runs again only when what it builds
# from changed (pyproject.toml, setup.py, ext/: a stamp under build/stamps); kvcache is
# installed editable, so a change to kvcache/*.py needs no install at all.
HOST_PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=
ifeq ($(origin PYTHON),undefined)
ifneq ($(VIRTUAL_ENV),)
PYTHON := $(VIRTUAL_ENV)/bin/python
else
PYTHON := $(VENV)/bin/python
endif
endif
ifeq ($(PYTHON),$(VENV)/bin/python)
# the recipes run as in an activated venv: Spark's workers and `kvcache` come from it too
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
# (its pyvenv.cfg, not bin/python: a symlink, whose time is the base interpreter's)
VENV_MADE := $(VENV)/pyvenv.cfg
endif

# What an install builds from: a newer one (or a new ./.venv) installs again.
INSTALL_INPUTS := pyproject.toml setup.py MANIFEST.in $(wildcard ext/*.pyx ext/*.pxd ext/*.h)
# one stamp per interpreter installed into
STAMPS := build/stamps/$(shell printf '%s' '$(abspath $(PYTHON))' | cksum | cut -d' ' -f1)

# setuptools' notice for every editable install of a flat layout ("Editable installation ...
# be careful with folders ... the same name as your package"), 9 lines that tell a user nothing
QUIET_EDITABLE = PYTHONWARNINGS="ignore:Editable installation"

.PHONY: demo test test-workers quick mutation lint typecheck debug install install-test install-mutation native-deps system-deps clean \
        fuzz fuzz-short fuzz-deps install-fuzz

APT = if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $(1) >/dev/null; \
      else sudo apt-get update -qq && sudo apt-get install -y -qq $(1) >/dev/null; fi

install: $(STAMPS)/install
install-test: $(STAMPS)/install-test
install-mutation: $(STAMPS)/install-mutation
install-fuzz: $(STAMPS)/install-fuzz

# the package and the demo extra: what README.md's examples use (redis-py, locust), nothing
# outside the virtualenv (libnetfilter-queue-dev, Java and redis-tools are the tests' only)
$(STAMPS)/install: $(INSTALL_INPUTS) $(VENV_MADE)
	@$(MAKE) --no-print-directory native-deps
	$(QUIET_EDITABLE) $(PYTHON) -m pip install -q -e ".[demo]"
	@mkdir -p $(@D) && touch $@

# the test extra includes the package and the demo extra: `make demo` after `make test`
# installs nothing
$(STAMPS)/install-test: $(INSTALL_INPUTS) $(VENV_MADE) tests/node/package-lock.json
	@$(MAKE) --no-print-directory native-deps system-deps
	$(QUIET_EDITABLE) $(PYTHON) -m pip install -q -e ".[test]"
	@# node-redis and ioredis, pinned in tests/node/package-lock.json (tests/test_node_clients.py)
	@if command -v npm >/dev/null; then npm ci --prefix tests/node --no-audit --no-fund --loglevel=error; fi
	@mkdir -p $(@D) && touch $@ $(@D)/install

# mutmut, for `make mutation` (the mutation extra), beside the test extra
$(STAMPS)/install-mutation: $(STAMPS)/install-test
	$(QUIET_EDITABLE) $(PYTHON) -m pip install -q -e ".[test,mutation]"
	@mkdir -p $(@D) && touch $@

# atheris, for `make fuzz` (the fuzz extra), beside the test extra whose vectors seed it
$(STAMPS)/install-fuzz: $(STAMPS)/install-test
	$(QUIET_EDITABLE) $(PYTHON) -m pip install -q -e ".[test,fuzz]"
	@mkdir -p $(@D) && touch $@

# ./.venv (Debian's python3 needs python3-venv for it: installed when missing)
$(VENV)/pyvenv.cfg:
	@echo "kvcache: making $(VENV), this project's virtualenv, with $(HOST_PYTHON)"
	@$(HOST_PYTHON) -m venv $(VENV) >/dev/null 2>&1 || { rm -rf $(VENV); \
	  $(call APT,python3-venv) && $(HOST_PYTHON) -m venv $(VENV); } || exit 1
	@$(VENV)/bin/python -m pip install -q --upgrade pip

# A C compiler and the Python headers build the native paths (LMDB, for the GET path, is
# compiled in from the `lmdb` sdist: no system library); without them setup.py skips the
# extensions (their pure-Python twins serve, and the sidecar says so), so a failure here is
# only a warning.
native-deps:
	@if { ! command -v cc >/dev/null || ! $(HOST_PYTHON) -c 'import os, sys, sysconfig; \
	      sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("include"), "Python.h")))'; } \
	    && command -v apt-get >/dev/null; then \
	  $(call APT,gcc python3-dev) || echo "warning: no C compiler or Python headers; the native paths run in Python"; \
	fi

# redis-server/redis-cli/redis-benchmark are third-party peers in the tests (Debian packages).
# Java 17 for the Spark jobs' tests (kvcache load / hotkeys), when there is no java at all.
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then \
	  $(call APT,redis-server redis-tools); \
	fi
	@# Prometheus and promtool: tests/test_metrics.py scrapes a sidecar with a real server,
	@# tests/test_deploy.py checks deploy/'s alert rules with promtool
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  $(call APT,prometheus); \
	fi
	@# systemd-analyze: tests/test_deploy.py verifies deploy/'s systemd unit with it
	@if ! command -v systemd-analyze >/dev/null; then \
	  $(call APT,systemd); \
	fi
	@# curl: README.md's metrics snippet (tests/test_readme.py runs it)
	@if ! command -v curl >/dev/null; then \
	  $(call APT,curl); \
	fi
	@if ! command -v java >/dev/null; then \
	  $(call APT,openjdk-17-jre-headless); \
	fi
	@# ip (iproute2) and iptables: tests/test_partition.py and bench/partition_bench.py put servers
	@# and the sidecar in network namespaces and cut links between them; libnetfilter-queue-dev:
	@# their packet shaper (NetfilterQueue, in the test extra)
	@if ! command -v ip >/dev/null || ! command -v iptables >/dev/null \
	    || [ ! -f /usr/include/libnetfilter_queue/libnetfilter_queue.h ]; then \
	  $(call APT,iproute2 iptables libnetfilter-queue-dev); \
	fi
	@# Node and npm for the node-redis / ioredis tests
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
	  $(call APT,nodejs npm) || echo "warning: no Node.js; tests/test_node_clients.py will skip"; \
	fi

# The sidecar on an embedded nats-server with a demo bucket; Ctrl-C stops it.
# (KVCACHE_EMBEDDED_PORT=4222 make demo: the embedded server on a port the `nats` CLI can name.)
demo: install
	@if [ "$(PYTHON)" = "$(VENV)/bin/python" ]; then \
	  echo "kvcache is installed in $(VENV): '. $(VENV)/bin/activate' puts the kvcache command on PATH"; fi
	$(PYTHON) -m kvcache serve --data-dir ./kvcache-data

test: system-deps install-test
	$(MAKE) --no-print-directory lint typecheck
	$(PYTHON) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
	# the socket path once more on the pure-Python twins of the native readers
	KVCACHE_NO_EXTENSIONS=1 $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_server.py tests/test_commands.py tests/test_client.py tests/test_hostile.py tests/test_tracking.py
	# what serves, once more with two worker processes per sidecar (workers = 2)
	$(MAKE) --no-print-directory test-workers

# The suites of what serves (the socket, tracking, streams, pub/sub, MULTI, CLIENT, AUTH,
# MINREV, the read matrix, partitions) with every sidecar they start at workers = 2
# (KVCACHE_WORKERS): their clients spread over two processes and the sidecar's own, and the
# socket file removed while serving (tests/test_workers.py covers the rest of workers itself).
WORKER_SUITES = tests/test_server.py tests/test_tracking.py tests/test_tracking_flush.py tests/test_streams.py \
    tests/test_pubsub.py tests/test_multi.py tests/test_client_list.py tests/test_client_reply.py tests/test_auth.py \
    tests/test_minrev_live.py tests/test_read_matrix_live.py tests/test_partition.py tests/test_redis_compat.py \
    tests/test_pipelined_reads.py tests/test_staleness.py \
    tests/test_host_faults.py::test_removed_socket_is_made_again \
    tests/test_host_faults.py::test_socket_that_cannot_be_made_again_is_not_ready
test-workers: install-test
	KVCACHE_WORKERS=2 $(PYTHON) -m pytest -q -p no:cacheprovider $(WORKER_SUITES)

# The habits `make test` runs first, on their own: ruff (rules in pyproject.toml), mypy on kvcache/.
lint: install-test
	$(PYTHON) -m ruff check kvcache tests bench setup.py

typecheck: install-test
	$(PYTHON) -m mypy kvcache

# The tests that start no server (nats-server, redis-server, a sidecar, Spark): seconds, not minutes.
quick: install-test
	$(PYTHON) -m pytest -q -p no:cacheprovider -m quick $(PYTEST_ARGS)

# Mutation testing of the modules that decide what a read may answer (pyproject.toml,
# [tool.mutmut]: the modules, and the tests run against them: in-process ones, and the router's
# peers against one nats-server per test module): mutmut makes each
# mutant in ./mutants and runs only the tests that reach the mutated function. Then the score
# per module and tests/mutation/survivors.md, which must give a reason for every mutant no test
# kills: an unexplained survivor fails the target. From scratch each time (a result kept from
# an earlier run would not see a test changed since); about 35 minutes with one worker on 2 busy
# cores (reads.py about 12 of them, the router and its peers about 15).
# MUTATION_JOBS: mutmut's workers.
MUTATION_JOBS ?= 2
mutation: install-mutation
	rm -rf mutants
	@mkdir -p build
	@echo "mutmut: mutants of the read decisions against the in-process tests (log: build/mutmut.log)"
	@nice -n 10 $(PYTHON) -m mutmut run --max-children $(MUTATION_JOBS) > build/mutmut.log 2>&1 \
	  || { tail -c 3000 build/mutmut.log; exit 1; }
	@grep -a -o '[0-9.]* mutations/second' build/mutmut.log | tail -1
	$(PYTHON) tests/mutation/report.py

# The Cython extensions rebuilt for gdb/valgrind: -O0 -g3, bounds and wraparound checks on,
# annotated HTML next to each .pyx (ext/*.html). The next `make install` (or `make demo`) rebuilds
# the optimized ones: this drops the install stamps.
debug:
	KVCACHE_DEBUG_BUILD=1 $(PYTHON) setup.py build_ext --inplace --force
	rm -f $(STAMPS)/install $(STAMPS)/install-test

# Coverage-guided fuzzing of the native readers (tests/fuzz/): each harness feeds a native
# module and its pure-Python twin the same bytes, whole and cut, and fails on any difference;
# the extensions are built again by clang with ASan, UBSan and libFuzzer's counters into
# build/fuzz/ (the modules in place stay as they are), and every sanitizer report fails too.
# FUZZ_SECONDS per reader; the corpus grows in build/fuzz/corpus/, findings go to
# build/fuzz/findings/. clang comes from apt when missing, atheris with the fuzz extra.
FUZZ_SECONDS ?= 60
FUZZ_READERS ?= resp_request,resp_reply,nats,server_get
FUZZ_EVERY_SPLIT ?= 0
FUZZ_BUILD := build/fuzz

fuzz: fuzz-deps $(FUZZ_BUILD)/built
	$(PYTHON) tests/fuzz/run.py --build $(FUZZ_BUILD) --seconds $(FUZZ_SECONDS) --readers $(FUZZ_READERS) \
	  --every-split $(FUZZ_EVERY_SPLIT)

# The short run for CI: 20 s per reader, inputs of up to 64 bytes also cut at every boundary
# (about 2.5 minutes on 2 cores with the sanitized build, when clang and atheris are there)
# (target-specific values, not a second make: one started before ./.venv exists would take
# the VIRTUAL_ENV this one exports for an active virtualenv and never make it)
fuzz-short: FUZZ_SECONDS = 20
fuzz-short: FUZZ_EVERY_SPLIT = 64
fuzz-short: fuzz

fuzz-deps: install-fuzz
	@if ! command -v clang >/dev/null || ! command -v clang++ >/dev/null; then $(call APT,clang); fi

$(FUZZ_BUILD)/built: $(INSTALL_INPUTS) tests/fuzz/build_sanitized.sh | fuzz-deps
	tests/fuzz/build_sanitized.sh $(PYTHON) $(FUZZ_BUILD)
	@touch $@

clean:
	rm -rf build dist *.egg-info kvcache-data mutants ext/*.c ext/*.html kvcache/_native/*.so $(VENV)
	find . -name __pycache__ -type d -prune -not -path "./.git/*" -exec rm -rf {} +
