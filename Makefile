# `make demo` and `make test` build .venv from nothing but python3 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench samples clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m compileall -q metric_core cli  # where PYTHONDONTWRITEBYTECODE is set, too
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/metriclog reduce sample_logs/rl_run --steps 0:3
	$(BIN)/metriclog reduce sample_logs/rl_run --mode per_rank_reduce --key "policy/*" --reduce "policy/latency_s=p99" --steps 178:182
	$(BIN)/metriclog inspect sample_logs/rl_run

test: $(STAMP)
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check metric_core cli tests benchmarks scripts
	$(BIN)/mypy metric_core

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_record.py

samples: $(STAMP)
	$(BIN)/python scripts/make_sample_logs.py sample_logs/rl_run

clean:
	rm -rf $(VENV) .pytest_cache
