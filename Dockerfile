# attention-service container image.
#
#   docker build -t attention-service:dev .        where a Docker engine exists
#   scripts/build-image [--smoke-test]              without one (buildah + debootstrap)
#
# Two stages: a full Debian bookworm with the build dependencies compiles the server and the
# CLI; a bookworm-slim stage gets only the shared libraries they link against (the same
# scripts/install-deps the README and CI use decides both lists) and runs as a non-root user.
#
# CUDA variant: --build-arg CUDA=1 also builds the CUDA backend plugin, with the CUDA
# toolkit from NVIDIA's Debian 12 repository in the build stage and cuBLAS in the runtime
# stage (scripts/install-cuda); the base stays Debian. Run it with a GPU (NVIDIA container
# toolkit) and --device=cuda; without one it serves on the CPU.
#   docker build --build-arg CUDA=1 -t attention-service:dev-cuda .
#
# OCI labels and --version come from build args, which scripts/build-image fills in:
#   --build-arg VERSION=0.1.0 --build-arg REVISION=$(git rev-parse --short HEAD)
#   --build-arg SOURCE=<repository URL> --build-arg CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
# (REVISION empty: --version says "revision unknown", as the context has no .git.)
#
# HEALTHCHECK (Docker, Podman; kept by buildah with --format docker; Kubernetes ignores it
# and uses deploy/kubernetes' gRPC probes): attention-cli --health asks grpc.health.v1 on
# the default port 50051 over plaintext. A server started with another --listen port or
# with TLS needs its own health check (docker run --health-cmd=...).

# 0: CPU only; 1: with the CUDA backend.
ARG CUDA=0

# ---- build stage -------------------------------------------------------------------------
FROM debian:bookworm AS build

# Parallel compile jobs; empty = one per CPU the build sees.
ARG BUILD_JOBS=
ARG CUDA

WORKDIR /src
# Dependencies first, from the script alone, so editing sources keeps this layer cached.
COPY scripts/install-deps scripts/install-deps
RUN scripts/install-deps --build && rm -rf /var/lib/apt/lists/*
COPY scripts/install-cuda scripts/install-cuda
RUN if [ "$CUDA" = 1 ]; then scripts/install-cuda --build && rm -rf /var/lib/apt/lists/*; fi

COPY . .
# Git revision --version prints (CMake's ATTENTION_GIT_REVISION); empty = "unknown". Declared
# here, since a new value misses the cache of every RUN after it.
ARG REVISION=
RUN cmake -S . -B /tmp/build -DCMAKE_BUILD_TYPE=Release -DATTENTION_BUILD_TESTS=OFF \
      -DATTENTION_CUDA="$([ "$CUDA" = 1 ] && echo ON || echo OFF)" \
      -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
      -DATTENTION_GIT_REVISION="${REVISION:-unknown}" \
 && cmake --build /tmp/build -j"${BUILD_JOBS:-$(nproc)}" \
 && cmake --install /tmp/build --prefix /opt/attention --strip \
 && mkdir -p /opt/attention/lib/attention-service \
 && rm -rf /tmp/build

# ---- runtime stage -----------------------------------------------------------------------
FROM debian:bookworm-slim
ARG CUDA

COPY scripts/install-deps /tmp/install-deps
COPY scripts/install-cuda /tmp/install-cuda
# Packages install without docs, man pages and translations (dpkg path excludes, as in
# Debian's official slim images; copyright files stay), and apt's package lists and caches
# (/var/cache/apt/*.bin: tens of MB) go in the same layer, so no layer keeps them.
RUN printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
      'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
      'path-exclude /usr/share/locale/*' 'path-exclude /usr/share/lintian/*' \
      >/etc/dpkg/dpkg.cfg.d/attention-slim \
 && /tmp/install-deps --runtime \
 && if [ "$CUDA" = 1 ]; then /tmp/install-cuda --runtime; fi \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old \
      /var/lib/dpkg/*-old /var/log/apt /var/log/dpkg.log /var/log/alternatives.log \
      /tmp/install-deps /tmp/install-cuda

# Fixed numeric ids so Kubernetes' runAsNonRoot can verify the user without /etc/passwd.
RUN groupadd --system --gid 10001 attention \
 && useradd --system --uid 10001 --gid attention --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin attention

COPY --from=build /opt/attention/bin/attention-server /opt/attention/bin/attention-cli \
     /usr/local/bin/
# The CUDA backend plugin (empty in the CPU variant); the server finds it in
# ../lib/attention-service/ of its own directory.
COPY --from=build /opt/attention/lib/attention-service/ /usr/local/lib/attention-service/

USER 10001:10001
# 50051: gRPC (attention.v1, grpc.health.v1, reflection). 9464: Prometheus /metrics.
EXPOSE 50051 9464
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/attention-cli", "--target=127.0.0.1:50051", "--health"]
# Flags given to `docker run IMAGE ...` are appended; a later --listen overrides this one.
ENTRYPOINT ["/usr/local/bin/attention-server", "--listen=0.0.0.0:50051"]

# Last, so that a new CREATED or REVISION rebuilds only this layer.
ARG VERSION=
ARG REVISION=
ARG SOURCE=
ARG CREATED=
LABEL org.opencontainers.image.title="attention-service" \
      org.opencontainers.image.description="Multi-head attention over gRPC (attention.v1)" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.source="$SOURCE" \
      org.opencontainers.image.created="$CREATED"
