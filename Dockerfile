# syntax=docker/dockerfile:1
# hapd: one container per machine runs the daemon (`hapd serve`); the launcher
# (`./run_all`, `python -m launcher`) reaches every machine's daemon over ZeroMQ.
# README "Docker" has a 2-machine example, and the flags podman needs.
#
#   docker build -t hapd .                                   # or: make image
#   docker run -d --name hapd --gpus all --network host --ipc host \
#       -v "$PWD/hapd.key:/etc/hapd/key:ro" -v hapd-state:/var/lib/hapd hapd
#
# BASE is any image with apt (Debian or Ubuntu), with or without Python and torch:
# - the default, the official PyTorch image, carries the torch that .ci/oldest.txt pins
#   (torch==2.9.1), and hapd installs beside it without reinstalling torch;
# - a bare Debian (e.g. `debootstrap bookworm` imported with `podman import`, as
#   bench/container_cluster.py makes it) gets Python from Debian and torch from PyPI
#   (the CUDA build, about 4.5 GB of nvidia-* wheels beside it).
# Graph ids depend on what torch.export emits, so every machine of a cluster (and the
# launcher's machine, which exports graphs) runs the same torch.
# The RUN steps are POSIX sh (an OCI-format build ignores SHELL). Behind a proxy that
# re-signs TLS, give its CA bundle as the build secret `ca` (`--secret id=ca,src=FILE`):
# the steps that download use it, and it stays out of the image.
# Every step needs only PyPI, crates.io, static.rust-lang.org and the base's apt mirror.
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

# ---- build: the abi3 wheel, built by pip through pyproject.toml's maturin backend (the
# build `make install` runs), with a Rust toolchain that stays in this stage
FROM ${BASE} AS build
ENV DEBIAN_FRONTEND=noninteractive
# a C toolchain (the Rust linker), curl and certificates (rustup), and Python with venv
# where the base has none (${python} splits into package names on purpose)
# hadolint ignore=DL3008,SC2086
RUN python="" && { python3 -c 'import ensurepip, venv' 2>/dev/null || python="python3 python3-venv"; } \
 && apt-get update \
 && apt-get install -y --no-install-recommends build-essential ca-certificates curl ${python} \
 && rm -rf /var/lib/apt/lists/*
# rustup-init straight from static.rust-lang.org (checked against its published sha256;
# POSIX sh has no pipefail: sha256sum -c fails the step on a short or failed download)
ARG RUST_VERSION=1.95.0
# hadolint ignore=DL4006
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then \
      export SSL_CERT_FILE="$ca" CURL_CA_BUNDLE="$ca" PIP_CERT="$ca" CARGO_HTTP_CAINFO="$ca"; fi \
 && target="$(uname -m)-unknown-linux-gnu" \
 && url="https://static.rust-lang.org/rustup/dist/${target}/rustup-init" \
 && curl --proto '=https' --tlsv1.2 -sSfL -o /tmp/rustup-init "${url}" \
 && echo "$(curl --proto '=https' --tlsv1.2 -sSfL "${url}.sha256" | cut -d' ' -f1)  /tmp/rustup-init" | sha256sum -c - \
 && chmod +x /tmp/rustup-init \
 && /tmp/rustup-init -y --no-modify-path --profile minimal --default-toolchain "${RUST_VERSION}" \
 && rm /tmp/rustup-init
ENV PATH=/root/.cargo/bin:${PATH}
WORKDIR /src
# the Rust extension first, from a layer that depends on rustcore/ and pyproject.toml only:
# the wheel is built once around empty placeholder packages, which leaves the compiled
# crates in rustcore/target, so an edit under hapd/ or launcher/ rebuilds no Rust (cargo
# finds every crate fresh below and maturin only packs the Python files)
COPY pyproject.toml README.md ./
COPY rustcore ./rustcore
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then \
      export SSL_CERT_FILE="$ca" CURL_CA_BUNDLE="$ca" PIP_CERT="$ca" CARGO_HTTP_CAINFO="$ca"; fi \
 && python3 -m venv /opt/build \
 && mkdir -p hapd launcher && touch hapd/__init__.py launcher/__init__.py \
 && /opt/build/bin/python -m pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/rust-only . \
 && rm -rf /tmp/rust-only hapd launcher
# then the Python packages: edits to tests, bench or docs keep both layers cached
COPY hapd ./hapd
COPY launcher ./launcher
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then \
      export SSL_CERT_FILE="$ca" CURL_CA_BUNDLE="$ca" PIP_CERT="$ca" CARGO_HTTP_CAINFO="$ca"; fi \
 && /opt/build/bin/python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime: the base, Python (the base's, else Debian's), torch (the base's, else
# PyPI's at the pinned version) and hapd with the launcher from the wheel
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
        apt-get update \
     && apt-get install -y --no-install-recommends python3 python3-venv \
     && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv --system-site-packages /opt/hapd/venv
# the venv sees the base's packages: a torch already there satisfies hapd's requirement
ENV PATH=/opt/hapd/venv/bin:${PATH}
COPY .ci/oldest.txt /tmp/wheels/constraints.txt
COPY --from=build /wheels /tmp/wheels
RUN --mount=type=secret,id=ca \
    ca=/run/secrets/ca; if [ -s "$ca" ]; then \
      export SSL_CERT_FILE="$ca" CURL_CA_BUNDLE="$ca" PIP_CERT="$ca" CARGO_HTTP_CAINFO="$ca"; fi \
 && python -m pip install --no-cache-dir -c /tmp/wheels/constraints.txt /tmp/wheels/hapd-*.whl \
 && rm -rf /tmp/wheels \
 && python -c 'import torch, hapd._core; print("torch", torch.__version__)'
WORKDIR /opt/hapd
# the entry scripts (./run_all, worker.py, ddp.py, fsdp.py) and the bundled cluster
# profiles; `--profile paper-8` looks for profiles/ beside the installed hapd package
COPY run_all worker.py ddp.py fsdp.py ./
COPY profiles ./profiles
RUN cp -r profiles "$(python -c 'import hapd, pathlib; print(pathlib.Path(hapd.__file__).parent.parent)')/profiles" \
 && mkdir -p /etc/hapd /var/lib/hapd /var/spool/hapd
ENV HAPD_HOME=/var/lib/hapd \
    HAPD_KEY_FILE=/etc/hapd/key \
    PYTHONUNBUFFERED=1
# state (plan cache, logs, jobs) and the drop folder: mount both to keep them; the key
# is a file mounted read-only at /etc/hapd/key (mode 0600, the same on every machine)
VOLUME ["/var/lib/hapd", "/var/spool/hapd"]
EXPOSE 5557
# a daemon starts processes: it listens beyond loopback only because --bind says so,
# and answers only messages signed with the mounted key
CMD ["hapd", "serve", "--bind", "tcp://0.0.0.0:5557", "--key", "/etc/hapd/key", "--state", "/var/lib/hapd", \
     "--watch", "/var/spool/hapd"]
