# te_passes: `make demo` (set up + main job on the built-in example), `make test` (set up + tests).
# TORCH picks the torch of the environment (2.15.0 default, 2.14.1): one venv per torch version
# (docs/install.md); TE_PASSES_VENV overrides the venv's path.
TORCH ?= 2.15.0
VENV ?= $(or $(TE_PASSES_VENV),$(HOME)/.cache/te_passes/venv-torch$(TORCH))
PYTEST_ARGS ?=
DUMP ?= te_passes_dump

.PHONY: setup demo lint test test-gpu bench

setup:
	@TORCH=$(TORCH) TE_PASSES_VENV=$(VENV) bash scripts/setup_env.sh

demo: setup
	$(VENV)/bin/te-passes dump --example linear-fp8 --out $(DUMP)

# The layer rule (pyproject.toml [tool.importlinter]; docs/design.md#layers), this checkout's sources.
lint: setup
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --config $(CURDIR)/pyproject.toml

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-gpu: setup
	$(VENV)/bin/python -m pytest -m gpu $(PYTEST_ARGS)

# CPU benchmarks (side-by-side ratios printed in one run); GPU: benchmarks/bench_gpu.py on the H200.
bench: setup
	$(VENV)/bin/python benchmarks/bench_pass_scaling.py
	$(VENV)/bin/python benchmarks/bench_hoist_constants.py
	$(VENV)/bin/python benchmarks/bench_memory_estimate.py
	$(VENV)/bin/python benchmarks/bench_ub_guard.py
	PYTHONPATH=. $(VENV)/bin/python benchmarks/bench_amax_hooks.py
