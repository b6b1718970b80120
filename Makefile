# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test test-deep lint docs bench bench-quick mutate clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-examples: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[examples]'
	touch $@

$(VENV)/.installed-test: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[test]'
	touch $@

$(VENV)/.installed-docs: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[docs]'
	touch $@

$(VENV)/.installed-bench: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[test,bench]'
	touch $@

$(VENV)/.installed-mutate: pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[test,mutate]'
	touch $@

demo: $(VENV)/.installed-examples
	$(PY) examples/demo.py

test: $(VENV)/.installed-test
	$(PY) -m ruff check raggedfn tests property_tests benchmarks examples
	$(PY) -m pytest -q -n auto --dist loadfile --durations=15

# nightly-style: 20,000 generated per-sample programs through raggedfn.map vs the loop
# (property_tests/map_oracle.py); prints counts per outcome, times and shrunk reproducers.
# `make test-deep SEED=n` for other programs (a failure of `make test` prints its seed),
# DEEP_WORKERS processes check them (one torch thread each)
SEED ?= 0
DEEP_WORKERS ?= 2
test-deep: $(VENV)/.installed-test
	$(PY) -m property_tests.map_oracle --programs 20000 --seed $(SEED) --workers $(DEEP_WORKERS)

lint: $(VENV)/.installed-test
	$(PY) -m ruff check raggedfn tests property_tests benchmarks examples
	$(PY) -m ruff format --check raggedfn tests property_tests benchmarks examples
	$(PY) -m mypy raggedfn

# the site (API reference from the docstrings) into site/; warnings are errors
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# one thread by default: two threads on the shared 2-core machine are noisy
# (docs/benchmarks.md); `make bench BENCH_THREADS=2` to override
BENCH_THREADS ?= 1

bench: $(VENV)/.installed-bench
	$(PY) -m benchmarks.run --threads $(BENCH_THREADS)

bench-quick: $(VENV)/.installed-bench
	$(PY) -m benchmarks.run --quick --threads $(BENCH_THREADS)

# mutation testing (docs/testing.md), not part of `make test`: slices in build/mutate/,
# niced (the machine is shared); MUTATE_SLICES, MUTATE_SAMPLE, MUTATE_JOBS, MUTATE_PARALLEL to choose
mutate: $(VENV)/.installed-mutate
	nice -n 10 $(PY) -m tests.mutate

clean:
	rm -rf $(VENV) build site *.egg-info
