# hapd developer entry points. `make demo` and `make test` are the README's two
# commands; both install everything they need into .venv first.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CARGO  ?= cargo
# the second environment: the newest torch the range allows (pyproject.toml)
NEWEST ?= .venv-newest
# pytest workers of `make test` (pytest-xdist; a test file runs whole on one worker, so
# its module fixtures are built once): two keep both cores of a small machine busy while
# one worker waits on ranks, daemons or subprocesses; --no-loadscope-reorder keeps the
# files in the longest-first order tests/conftest.py gives them (xdist would sort them by
# test count)
TEST_WORKERS ?= 2
PYTEST = $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30
# the exactness and zoo tests, run again under the newest torch
NEWEST_TESTS ?= tests/models/test_zoo.py tests/spmd/test_dropout.py tests/spmd/test_frozen.py tests/ir/test_lowering.py
# `make image`: the image's tag, its base (empty: the Dockerfile's default, the official
# PyTorch image) and a CA bundle the build's downloads trust behind a proxy that re-signs
# TLS (given to the build as the secret `ca`, never stored in the image), and more flags
# for the builder (e.g. --no-cache)
IMAGE     ?= hapd
BASE      ?=
CA_BUNDLE ?= $(SSL_CERT_FILE)
IMAGE_FLAGS ?=
comma     := ,
IMAGE_ARGS = $(IMAGE_FLAGS) $(if $(BASE),--build-arg BASE=$(BASE)) $(if $(CA_BUNDLE),--secret id=ca$(comma)src=$(CA_BUNDLE)) -t $(IMAGE)

.PHONY: install demo test test-rust test-python pytest test-newest image bench clean

# Installs run through uv (from PyPI into each environment): it resolves as pip does but
# unpacks in parallel and links files from its cache, so the CUDA build of torch and its
# libraries (several GB) install in ~30 s cold and ~2 s warm, against ~100 s with pip.
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, a process would
# otherwise compile torch on every import (a 1.6 s import becomes 3 s; the suite 900 s → 1500 s).
$(PY):
	$(PYTHON) -m venv $(VENV)

# Builds the abi3 extension (release) and installs hapd editable with its test extras,
# under the oldest torch of the supported range (.ci/oldest.txt). An editable install
# leaves hapd's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE is set every
# process (each rank, daemon and launcher the tests start) would compile them again on
# import, ~0.7 s of CPU each: compileall writes their bytecode once (files already up to
# date are skipped; a stale one is recompiled in memory by the importer).
install: $(PY)
	test -x $(VENV)/bin/uv || $(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e '.[test]' -c .ci/oldest.txt
	$(PY) -m compileall -q -j 0 hapd launcher bench tests

# The main job on the embedded default: synthesize and explain a plan for the tiny BERT
# on the paper's 8-device V100/P100 cluster, then train it with hapd on 2 local CPU
# ranks (Gloo) and print per-iteration timings.
demo: install
	$(VENV)/bin/hapd export bert --batch 64 --out $(VENV)/demo/bert.pt2
	$(VENV)/bin/hapd compile $(VENV)/demo/bert.hapg --profile paper-8 --explain
	./run_all worker.py 2 -- --model bert --batch 32 --iterations 20

# `+`: cargo takes its build jobs from make's jobserver (`make test` runs it beside
# pytest with -j2, so it builds on one core and leaves pytest the other)
test-rust:
	+$(CARGO) test --manifest-path rustcore/Cargo.toml --workspace --exclude hapd-bindings -q

test-python: install
	$(PYTEST)

# The Rust tests run beside pytest (their build is ~25 s of CPU, which pytest's waits on
# ranks and daemons leave free); their few lines come while pytest's first are pending.
test: install
	$(MAKE) --no-print-directory -j2 test-rust pytest

pytest:
	$(PYTEST)

# The exactness and zoo tests under the newest torch of the range, in $(NEWEST).
test-newest:
	test -x $(NEWEST)/bin/python || $(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q uv
	$(NEWEST)/bin/uv pip install -q --compile-bytecode --python $(NEWEST)/bin/python -e '.[test]'
	$(NEWEST)/bin/python -m compileall -q -j 0 hapd launcher bench tests
	$(NEWEST)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(NEWEST)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(NEWEST_TESTS)

# The daemon's image (Dockerfile) with buildah where it is (no daemon needed: chroot
# isolation, the layer cache kept, a failed step's container removed), else docker.
image:
	@if command -v buildah >/dev/null 2>&1; then \
	    set -x; buildah bud --isolation chroot --layers --force-rm --format docker $(IMAGE_ARGS) . ; \
	elif command -v docker >/dev/null 2>&1; then \
	    set -x; docker build --force-rm $(IMAGE_ARGS) . ; \
	else \
	    echo "make image: needs buildah or docker (Debian: apt-get install buildah)" >&2; exit 2; \
	fi

clean:
	rm -rf $(VENV) $(NEWEST) rustcore/target hapd/_core*.so
