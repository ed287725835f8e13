# towerflow: two set-up commands.
#   make example   install into .venv, generate synthetic MNIST, train LeNet sync on 2 workers + 2 PS
#   make test      install into .venv (with test extras) and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# make test's first phase: two pytest-xdist workers, a module at a time each (docs/testing.md);
# `make test LANES=` runs it in one process.
LANES ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: example test bench install lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "towerflow needs Python 3.10+, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

data/mnist/manifest.json: | $(STAMP)
	$(BIN)/towerflow data synth mnist --out data/mnist

example: $(STAMP) data/mnist/manifest.json
	$(BIN)/towerflow train pipelines/mnist_sync.yaml

# Two phases (docs/testing.md): the tests on the session's embedded Ray, in LANES; then the modules
# that start a Ray cluster of their own, one after another with the machine to themselves. pytest
# exits 5 when it collected no tests: fine for one phase (PYTEST_ARGS may pick the other's tests
# only), a failure for both, so an empty run is never mistaken for a pass; any other code fails.
test: $(STAMP)
	@export TOWERFLOW_SUITE_STARTED=$$(date +%s); \
	$(BIN)/python -m pytest --phase=embedded $(LANES) $(PYTEST_ARGS); embedded=$$?; \
	$(BIN)/python -m pytest --phase=own-cluster $(PYTEST_ARGS); own=$$?; \
	for rc in $$embedded $$own; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done; \
	if [ $$embedded -eq 5 ] && [ $$own -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)"; exit 5; fi

# towerflow beside its peers (benchmarks/bench.py): about 15-17 minutes on 2 cores in a fast hour (16.7 on a fresh clone at 2026-11-28 02:50 UTC), 18-22 in a middling one (22.1 at 2026-11-27 12:21 UTC), 26-27 in a slow one (25.8 at 09:24 the same day; both before the driver's lighter start), 22.8 at 2026-12-07 04:56 in a slower hour; rewrites
# the generated section of docs/benchmarks.md and docs/img/bench-*.png.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[dev,bench]"
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) data/mnist .pytest_cache
