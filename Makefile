# te_passes: `make demo` (set up + main job on the built-in example), `make test` (set up + tests).
VENV ?= $(or $(TE_PASSES_VENV),$(HOME)/.cache/te_passes/venv)
PYTEST_ARGS ?=
DUMP ?= te_passes_dump

.PHONY: setup demo test test-gpu bench

setup:
	@TE_PASSES_VENV=$(VENV) bash scripts/setup_env.sh

demo: setup
	$(VENV)/bin/te-passes dump --example linear-fp8 --out $(DUMP)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-gpu: setup
	$(VENV)/bin/python -m pytest -m gpu $(PYTEST_ARGS)
