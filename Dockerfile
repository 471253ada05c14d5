# syntax=docker/dockerfile:1
# hapd: one container per machine runs the daemon (`hapd serve`); the launcher
# (`./run_all`, `python -m launcher`) reaches every machine's daemon over ZeroMQ.
# README "Docker" has a 2-machine example.
#
#   docker build -t hapd .
#   docker run -d --name hapd --gpus all --network host --ipc host \
#       -v "$PWD/hapd.key:/etc/hapd/key:ro" -v hapd-state:/var/lib/hapd hapd
#
# The base carries the torch that pyproject.toml pins (torch==2.9.1): graph ids depend
# on what torch.export emits, so every machine of a cluster runs the same torch.
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

# ---- build: the abi3 wheel, built by pip through pyproject.toml's maturin backend (the
# same build `make install` runs), with the Rust toolchain that compiles hapd._core
FROM ${BASE_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential ca-certificates curl \
 && rm -rf /var/lib/apt/lists/*
ARG RUST_VERSION=1.95.0
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --profile minimal --default-toolchain "${RUST_VERSION}"
ENV PATH=/root/.cargo/bin:${PATH}
WORKDIR /src
COPY . .
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime: torch from the base image, hapd (with the launcher) from the wheel
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /wheels /tmp/wheels
RUN python -m pip install --no-cache-dir /tmp/wheels/hapd-*.whl \
 && rm -rf /tmp/wheels
WORKDIR /opt/hapd
# the entry scripts (./run_all, worker.py, ddp.py) and the bundled cluster profiles;
# `--profile paper-8` looks for profiles/ beside the installed hapd package
COPY run_all worker.py ddp.py ./
COPY profiles ./profiles
RUN cp -r profiles "$(python -c 'import hapd, pathlib; print(pathlib.Path(hapd.__file__).parent.parent)')/profiles" \
 && mkdir -p /etc/hapd /var/lib/hapd
ENV HAPD_HOME=/var/lib/hapd \
    HAPD_KEY_FILE=/etc/hapd/key \
    PYTHONUNBUFFERED=1
VOLUME ["/var/lib/hapd"]
EXPOSE 5557
# a daemon starts processes: it listens beyond loopback only because --bind says so,
# and answers only messages signed with the mounted key (mode 0600)
CMD ["hapd", "serve", "--bind", "tcp://0.0.0.0:5557", "--key", "/etc/hapd/key", "--state", "/var/lib/hapd"]
