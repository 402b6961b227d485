# `make demo` and `make test` build .venv from nothing but python3 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench samples soak clean

# setup.py and the C source too: an editable install builds the extension in place once,
# so a change to either is built only by installing again
$(STAMP): pyproject.toml setup.py metric_core/offline/engine/_exact.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m compileall -q metric_core cli  # where PYTHONDONTWRITEBYTECODE is set, too
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/metriclog reduce sample_logs/rl_run --steps 0:3
	$(BIN)/metriclog reduce sample_logs/rl_run --mode per_rank_reduce --key "policy/*" --reduce "policy/latency_s=p99" --steps 178:182
	$(BIN)/metriclog inspect sample_logs/rl_run

# The whole suite with pytest-xdist, a worker per core and one more (-n auto, as
# tests/conftest.py counts it: the suite often waits on processes it started). Each worker
# has its own temporary directory, W&B directories and servers' ports (tests/conftest.py,
# tests/s3_server.py). `pytest` alone runs it in one process.
test: $(STAMP)
	$(BIN)/pytest -q -n auto --dist worksteal

# The edit loop, under a minute: the record, writer, reader, reductions, samples, the
# torchforge drop-in and the command line, without the slow cases (real jobs of several
# processes, the installed command run many times, object storage, Ray, kills, follows).
# `make test` runs everything.
FAST := tests/test_metric.py tests/test_writer.py tests/test_reader.py tests/test_reduce.py \
	tests/test_cli.py tests/test_samples.py tests/test_torchforge.py tests/torchforge tests/test_perf_tracker_run.py \
	tests/test_layout.py tests/test_plot.py tests/test_tensorboard.py tests/test_story.py
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow" $(FAST)

lint: $(STAMP)
	$(BIN)/ruff check metric_core cli tests benchmarks scripts
	$(BIN)/mypy metric_core

# The seeded soak (tests/soak/): random jobs with faults, every command checked against an
# exact oracle. `make soak SEED=1234` replays one seed; `make soak MINUTES=60` runs new
# seeds for that long (JOBS at a time, 3 by default) and prints a summary. A failure prints its seed and
# keeps its run directory. The fixed seeds of tests/soak/seeds.txt run in `make test`.
# ONLY=reduce,keys,... runs those checks alone, on the jobs the seeds made before the
# other checks joined (tests/soak/checks.py's CHECKS).
MINUTES ?= 10
# a job waits on its hangs and follows: three at a time keep two cores busy
JOBS ?= 3
soak: $(STAMP)
	$(BIN)/python -m tests.soak $(if $(SEED),$(foreach s,$(SEED),--seed $(s)),--minutes $(MINUTES)) --jobs $(JOBS) $(if $(ONLY),--only $(ONLY))

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_record.py

samples: $(STAMP)
	$(BIN)/python scripts/make_sample_logs.py sample_logs/rl_run

clean:
	rm -rf $(VENV) .pytest_cache
