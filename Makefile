# The two commands that matter: `make lab` and `make test`. Both build .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install only when the pins (pyproject.toml) change.
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv lab test fuzz demo bench bench-kernels labs grade clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

lab: venv
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=labs $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

labs: venv
	$(PY) -m grader labs

grade: venv
	@test -n "$(LAB)" || { echo "usage: make grade LAB=NN_name (one of: $$(ls solutions | grep -E '^[0-9]{2}_' | tr '\n' ' '))"; exit 2; }
	$(PY) -m pytest -q labs/$(LAB)

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The long randomized runs (tens of minutes): 2,000 scheduler examples (hypothesis), 300 random
# real-model sequences, KeyboardInterrupt at every line every step of a workload runs.
fuzz: venv
	FUZZ_SCHEDULER_EXAMPLES=2000 FUZZ_ENGINE_SEQUENCES=300 FUZZ_INTERRUPT_ALL_LINES=1 $(PY) -m pytest -q \
		tests/test_invariants.py tests/test_engine_fuzz.py tests/test_step_interrupts.py $(PYTEST_ARGS)

demo: venv
	$(PY) -m engine_core.demo

bench: venv
	$(PY) -m engine_core.bench --model small-llama --num-requests 64 --input-len 16:512 --output-len 16:256 --seed 0

bench-kernels: venv
	$(PY) -m kernels.bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
