# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first.
# `make test` runs the fast tier (no server process, cluster, browser or container: tests/tiers.py);
# `make test-all` runs every test, as CI does.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first, pinned: the CPU/GPU build on the local disk (other versions download gigabytes)
	$(BIN)/pip install torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -e ".[cpu,train,dev,milvus,milvus-server,ray]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/dmlsearch demo

# The fast tier in one process per core (pytest-xdist); each process computes on one thread
# (tests/conftest.py). --dist worksteal: each process starts on its half of the tests in file order (a file
# mostly stays in one process, its module fixtures made once), and one that runs out takes half of what the
# other has left, so neither sits idle at the end (--dist loadfile hands out whole files: the last may run
# alone).
test: setup
	$(BIN)/pytest -q -m "not slow" -n auto --dist worksteal

# Every test: the fast tier as `make test` does, then the slow tier in one process (its tests start servers,
# clusters, a browser and containers, and time their deadlines).
test-all: setup
	$(BIN)/pytest -q -m "not slow" -n auto --dist worksteal
	$(BIN)/pytest -q -m slow

lint: setup typecheck
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# mypy over foundation, index, engine, app, training and cli ([tool.mypy] in pyproject.toml): zero errors,
# kept so by `lint`.
typecheck: setup
	$(BIN)/mypy

clean:  # the demo's files only: artifacts/model and artifacts/index are the user's
	rm -rf artifacts/demo .pytest_cache
