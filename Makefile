# The two commands of the README. Both build .venv on first use (tools/install_cpu_env.sh).
.PHONY: demo test env clean-env

PY := .venv/bin/python
PYTEST_ARGS ?=

env:
	@bash tools/install_cpu_env.sh

demo: env
	$(PY) -m megatron_rl.cli demo

test: env
	$(PY) -m pytest $(PYTEST_ARGS)

clean-env:
	rm -rf .venv
