# Two entry points: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: venv test test-fast demo lint bench bench-quick clean chromium

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

# The web view's browser tests drive Debian's chromium; installed here when missing (as root on CI).
chromium:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    chromium chromium-driver >/dev/null) || echo "make: could not install chromium"

# Two workers, a test file each at a time (module fixtures stay in one process): 9 m 27 s
# for 1,930 tests on 2 quiet cores (docs/architecture.md: what keeps it there).
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, set
# on some machines): otherwise every worker re-runs pytest's assertion rewriting (~10 s of CPU)
# and every child process compiles the trajstore modules it imports.
test: $(STAMP) chromium
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 --dist loadfile

# The edit-run loop: unit tests only (no servers, browsers, trainers or child processes).
test-fast: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -m unit

LINT_PATHS := trajstore api migrations examples tests scripts

# Formatting is a habit, not a review comment: CI fails on an unformatted file or a long line.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)

demo: $(STAMP)
	$(PY) -m trajstore demo demo-store

# Every benchmark figure in one run (3 runs of each script, hours on 2 cores) and rewrites
# docs/benchmarks.md's generated block. `make bench ARGS="--only store,cli"` picks figures.
bench: $(STAMP)
	$(PY) scripts/bench/run.py --doc $(ARGS)

# The same figures on tiny sizes, once each: checks every script runs; the doc is untouched.
bench-quick: $(STAMP)
	$(PY) scripts/bench/run.py --quick $(ARGS)

clean:
	rm -rf $(VENV) demo-store demo-store-work
