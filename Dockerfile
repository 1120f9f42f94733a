# attention-service container image.
#
#   docker build -t attention-service:dev .        where a Docker engine exists
#   scripts/build-image [--smoke-test]              without one (buildah + debootstrap)
#
# Two stages: a full Debian bookworm with the build dependencies compiles the server and the
# CLI; a bookworm-slim stage gets only the shared libraries they link against (the same
# scripts/install-deps the README and CI use decides both lists) and runs as a non-root user.

# ---- build stage -------------------------------------------------------------------------
FROM debian:bookworm AS build

# Parallel compile jobs; empty = one per CPU the build sees.
ARG BUILD_JOBS=

WORKDIR /src
# Dependencies first, from the script alone, so editing sources keeps this layer cached.
COPY scripts/install-deps scripts/install-deps
RUN scripts/install-deps --build && rm -rf /var/lib/apt/lists/*

COPY . .
RUN cmake -S . -B /tmp/build -DCMAKE_BUILD_TYPE=Release -DATTENTION_BUILD_TESTS=OFF \
 && cmake --build /tmp/build -j"${BUILD_JOBS:-$(nproc)}" \
 && cmake --install /tmp/build --prefix /opt/attention --strip \
 && rm -rf /tmp/build

# ---- runtime stage -----------------------------------------------------------------------
FROM debian:bookworm-slim

LABEL org.opencontainers.image.title="attention-service" \
      org.opencontainers.image.description="Multi-head attention over gRPC (attention.v1)"

COPY scripts/install-deps /tmp/install-deps
RUN /tmp/install-deps --runtime \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /tmp/install-deps

# Fixed numeric ids so Kubernetes' runAsNonRoot can verify the user without /etc/passwd.
RUN groupadd --system --gid 10001 attention \
 && useradd --system --uid 10001 --gid attention --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin attention

COPY --from=build /opt/attention/bin/attention-server /opt/attention/bin/attention-cli \
     /usr/local/bin/

USER 10001:10001
# 50051: gRPC (attention.v1, grpc.health.v1, reflection). 9464: Prometheus /metrics.
EXPOSE 50051 9464
# Flags given to `docker run IMAGE ...` are appended; a later --listen overrides this one.
ENTRYPOINT ["/usr/local/bin/attention-server", "--listen=0.0.0.0:50051"]
