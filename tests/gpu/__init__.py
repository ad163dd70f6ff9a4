"""GPU tests (`pytest -m gpu tests/gpu`, `make test-gpu`): skipped where CUDA is absent."""
