# The two commands of the README, plus the edit loop. All build .venv on first use
# (tools/install_cpu_env.sh). `make test-gpu` runs the GPU tests with the GPU stack's Python (the
# image's, or GPU_PY=...).
.PHONY: demo test test-fast test-integration test-e2e test-slow test-gpu lint env clean-env

PY := .venv/bin/python
GPU_PY ?= python
PYTEST_ARGS ?=
# Two pytest-xdist workers, one per core (most of a test's time is waiting on a server or torchrun
# start); tests/conftest.py makes each file one unit of work. WORKERS=0: one process.
WORKERS ?= 2
PYTEST := $(PY) -m pytest $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)
# The gpu-marked tests (containers/selftest.py runs the same list inside the image).
GPU_TESTS := tests/gpu
# ruff and mypy run from the project venv; LINT_PY points them at another interpreter's.
LINT_PY ?= $(PY)

env:
	@bash tools/install_cpu_env.sh

demo: env
	$(PY) -m megatron_rl.cli demo

# Everything, as CI runs it (.ci/run): the four tiers of tests/ (CONTRIBUTING.md), in two workers;
# most of the time goes to the integration and e2e tiers (their vLLM server starts).
test: env
	$(PYTEST) $(PYTEST_ARGS)

# Refuses when CUDA is not there: a GPU stage whose tests all skip must not pass.
test-gpu:
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: CUDA is not available to $(GPU_PY) (torch ' + torch.__version__ + ')')"
	$(GPU_PY) -m pytest -m gpu $(PYTEST_ARGS) $(GPU_TESTS)

# The edit loop: tests/unit (no vLLM server, torchrun or Slurm job); under 2 minutes.
test-fast: env
	$(PYTEST) $(PYTEST_ARGS) tests/unit

# One real vLLM server (shared by most of them) or a torchrun group per test.
test-integration: env
	$(PYTEST) $(PYTEST_ARGS) tests/integration

# The trainer CLI end to end, Slurm jobs, the fault bench.
test-e2e: env
	$(PYTEST) $(PYTEST_ARGS) tests/e2e

# integration + e2e
test-slow: env
	$(PYTEST) $(PYTEST_ARGS) tests/integration tests/e2e

# Rules and settings in pyproject.toml ([tool.ruff], [tool.mypy]); .pre-commit-config.yaml runs the same.
lint: env
	$(LINT_PY) -m ruff check .
	$(LINT_PY) -m mypy --python-executable $(PY)

clean-env:
	rm -rf .venv
