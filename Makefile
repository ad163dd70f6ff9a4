# The two commands of the README. Both build .venv on first use (tools/install_cpu_env.sh).
# `make test-gpu` runs the GPU tests with the GPU stack's Python (the image's, or GPU_PY=...).
.PHONY: demo test test-gpu env clean-env

PY := .venv/bin/python
GPU_PY ?= python
PYTEST_ARGS ?=

env:
	@bash tools/install_cpu_env.sh

demo: env
	$(PY) -m megatron_rl.cli demo

test: env
	$(PY) -m pytest $(PYTEST_ARGS)

# Refuses when CUDA is not there: a GPU stage whose tests all skip must not pass.
test-gpu:
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: CUDA is not available to $(GPU_PY) (torch ' + torch.__version__ + ')')"
	$(GPU_PY) -m pytest -m gpu $(PYTEST_ARGS) tests/gpu tests/test_logprobs.py

clean-env:
	rm -rf .venv
