# make demo: set up and run the main job on the embedded corpus.  make test: set up and run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/default

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python train.py --config=configs/default.py --workdir=$(WORKDIR) --dry_run

test: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/pytest -n 2 --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) workdirs
