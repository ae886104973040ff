# kvroute: `make demo` runs the main job, `make test` runs every test.
# Both create .venv and build the extension by themselves.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.deps-installed

.PHONY: all demo test test-rust test-py test-vllm vllm-engines lint bench bench-rust bench-peers build-dev build-release clean

all: test

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

build-dev: $(STAMP)
	VIRTUAL_ENV=$(CURDIR)/$(VENV) $(BIN)/maturin develop

build-release: $(STAMP)
	VIRTUAL_ENV=$(CURDIR)/$(VENV) $(BIN)/maturin develop --release

# --force: each run regenerates kvroute-demo/ in place.
demo: build-release
	$(BIN)/kvroute demo --force

test: test-rust test-py

test-rust:
	cargo test --workspace --exclude kvroute-py

test-py: build-dev
	$(BIN)/pytest -q -m "not vllm"

# Real vLLM engines on CPU: the first run installs vLLM in a cached venv (about 5 min).
test-vllm: build-dev
	$(BIN)/pytest -q -m vllm

# Two real engines on ports 8101-8102 until Ctrl-C (ENGINES=N, PORT=P to change).
ENGINES ?= 2
PORT ?= 8101
vllm-engines: $(STAMP)
	$(PY) tests/realvllm.py serve --engines $(ENGINES) --port $(PORT)

lint: $(STAMP)
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(BIN)/ruff check python tests benches
	$(BIN)/ruff format --check python tests benches
	$(BIN)/mypy
	VIRTUAL_ENV=$(CURDIR)/$(VENV) $(BIN)/maturin develop --quiet
	$(BIN)/python -m mypy.stubtest kvroute._core --allowlist stubtest-allowlist.txt

bench: build-release
	$(BIN)/pytest benches -q --benchmark-only --benchmark-disable-gc --benchmark-columns=min,median,mean,ops,rounds

bench-rust:
	cargo bench -p kvroute-bench

# kvroute against SMG and vllm-router (from PyPI, cached) on two real vLLM CPU engines, every
# workload at light and heavy load, 3 rounds: benches/peers/run.py, results in benches/README.md.
bench-peers: build-release
	$(PY) benches/peers/run.py --json peers.json --markdown peers.md

clean:
	rm -rf $(VENV) target
