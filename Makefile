# Two commands set up a fresh machine: `make demo` and `make test`. Both create or refresh .venv from
# constraints.txt (exact versions; torch is the CPU build 2.13.0 from local disk).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: demo test lint typecheck pytest docs bench arena arena-long clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,kernels,trl,verl,demo,docs,notebooks,ray]'
	$(PY) -m pip install -q -c constraints.txt --no-deps verl==0.9.1
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m rolloutopt demo

# the arena's default suite (resumable: finished runs under benchmarks/results/arena/runs are skipped)
arena: $(STAMP)
	$(PY) -m rolloutopt arena --jobs $(JOBS)

# longer allocator runs (150 steps, rollout budget, 5 seeds; about 40 minutes on 2 cores), beside the default suite
arena-long: $(STAMP)
	$(PY) -m rolloutopt arena --family allocator --units rollouts --steps 150 --ramble 0 --out benchmarks/results/arena/long/runs --jobs $(JOBS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks docs_ext
	$(VENV)/bin/ruff format --check src tests benchmarks docs_ext

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest -n $(JOBS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir .site

test: lint typecheck docs pytest

bench: $(STAMP)
	$(PY) benchmarks/groups.py
	$(PY) benchmarks/ratios.py
	$(PY) benchmarks/allocators.py
	$(PY) benchmarks/control.py
	$(PY) benchmarks/kernels.py

clean:
	rm -rf $(VENV) .site .pytest_cache .mypy_cache .ruff_cache .hypothesis
