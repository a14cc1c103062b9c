PYTHON ?= python
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test

install:  ## keeps an installed torch (e.g. your CUDA build); otherwise installs torch==$(TORCH_VERSION)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -r requirements.txt

demo:  ## offline: build a tiny task, train it with rloo.py, plot the curves (~2 min on 2 CPU cores)
	$(PYTHON) benchmark/demo.py

test:  ## CPU, no network
	$(PYTHON) -m pytest -q tests
