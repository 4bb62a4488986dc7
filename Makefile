# Two commands do all set-up on a fresh machine:
#   make search   creates .venv, installs autotune, runs the default study with a short budget
#   make test     creates .venv, installs the dev and integrations extras, runs ruff and pytest
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Short enough for a first look on any machine; use `autotune search --budget 30m` for real.
BUDGET ?= 3m
SPEC ?= studies/resnet18.yaml
# Test processes (each takes a test file at a time).
TEST_JOBS ?= 3
OUT ?= gpu-check-out

# The GPU machine's torch: the tests that touch torch's version-sensitive APIs (compile,
# GradScaler and fused optimizers, TF32 and fp32_precision, memory statistics and fractions,
# RNG state, autocast) run on it too, in a venv of its own, so what breaks there breaks here
# first. The oldest torch pyproject.toml admits; `make test` runs the newest.
DEVICE_TORCH ?= 2.11.0
DEVICE_VISION ?= 0.26.0
VENV_DEVICE := .venv-torch$(DEVICE_TORCH)
TORCH_TESTS := tests/test_knobs.py tests/test_precision.py tests/test_probe.py tests/test_step.py \
	tests/test_paired.py tests/test_session.py tests/test_cuda_context.py tests/test_gpu.py \
	tests/test_diagnose.py tests/test_ceilings.py tests/test_train_cli.py

.PHONY: search test test-device-torch lint format docs gpu-check clean

$(VENV)/.runtime: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev,integrations]'
	touch $(VENV)/.runtime $@

search: $(VENV)/.runtime
	$(BIN)/autotune search $(SPEC) --budget $(BUDGET)

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# ruff; the package byte-compiled once (where PYTHONDONTWRITEBYTECODE is set, each process the
# suite starts, forty of them probe workers, would compile it afresh: 0.2 s of a core each); then
# the type check beside the tests (16 s of a core, while the tests mostly wait on workers and
# services): either failing fails the target. Three test processes on two cores (the real
# end-to-end tests mostly wait on workers and services), a test file each at a time: beside a
# busy process the suite took 290 s with three and 307 s with four.
test: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m compileall -q autotune tests >/dev/null
	$(BIN)/mypy & checker=$$!; \
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15; tests=$$?; \
	wait $$checker && exit $$tests

# The version-sensitive tests on the GPU machine's torch (its PyPI build runs on a CPU too).
$(VENV_DEVICE)/.dev: pyproject.toml
	test -x $(VENV_DEVICE)/bin/python || $(PYTHON) -m venv $(VENV_DEVICE)
	$(VENV_DEVICE)/bin/python -m pip install -q torch==$(DEVICE_TORCH) torchvision==$(DEVICE_VISION)
	$(VENV_DEVICE)/bin/python -m pip install -q -e . pytest pytest-timeout pytest-xdist hypothesis
	touch $@

test-device-torch: $(VENV_DEVICE)/.dev
	$(VENV_DEVICE)/bin/python -c 'import torch; assert torch.__version__.startswith("$(DEVICE_TORCH)"), torch.__version__'
	$(VENV_DEVICE)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist loadfile $(TORCH_TESTS)

# The documentation site, offline, into site/ (open site/index.html). --strict: a broken link,
# anchor or API reference fails the build; the suite builds it the same way (tests/test_docs.py).
# NO_MKDOCS_2_WARNING silences the theme's notice about a future MkDocs, which this build pins out.
docs: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

format: $(VENV)/.dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The GPU check, in calls that each fit a short session on a CUDA machine. `make gpu-check`
# prints the plan (the calls in order, their caps, timeouts and device time) and runs nothing;
# `make gpu-check CALL=tests-core` (then tests-integrations, then bench; or all) prints it and
# runs that call, results under $(OUT)/CALL: the same as `bash scripts/gpu-check.sh CALL $(OUT)`,
# which needs no make. GPU_CHECK_DRY_RUN=1 prints the call's commands instead of running them.
gpu-check:
	bash scripts/gpu-check.sh $(if $(CALL),$(CALL) $(OUT),--plan)

clean:
	rm -rf $(VENV) .venv-torch* build *.egg-info .pytest_cache .ruff_cache .mypy_cache site
