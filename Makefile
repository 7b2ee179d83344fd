PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NPROC  ?= 4

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: install
	$(BIN)/paratrain train --config examples/demo.toml

test: install
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python bench/step_time.py --json runs/bench/step_time.json

clean:
	rm -rf runs .pytest_cache
