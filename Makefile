# hapd developer entry points. `make demo` and `make test` are the README's two
# commands; both install everything they need into .venv first.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CARGO  ?= cargo

.PHONY: install demo test test-rust test-python bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Builds the abi3 extension (release) and installs hapd editable with its test extras.
install: $(PY)
	$(PY) -m pip install -q -e '.[test]'

demo: install
	$(VENV)/bin/hapd export bert --batch 8 --out $(VENV)/demo-bert.pt2

test-rust:
	$(CARGO) test --manifest-path rustcore/Cargo.toml --workspace --exclude hapd-bindings -q

test-python: install
	$(VENV)/bin/pytest -q

test: test-rust test-python

clean:
	rm -rf $(VENV) rustcore/target hapd/_core*.so
