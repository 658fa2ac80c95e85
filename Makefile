# The two commands users need: `make test` and `make bench`.
# Both build .venv on first use with the pinned CPU stack, then install this
# package editable.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 2

.PHONY: test unit distributed bench soak clean

$(STAMP): requirements-cpu.txt requirements-torchrec.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=23" "setuptools>=68" wheel
	$(PY) -m pip install --quiet -r requirements-cpu.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-torchrec.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, torchrec, fbgemm_gpu, trec_pipelines; print('stack ok: torch', torch.__version__)"
	touch $(STAMP)

test: unit distributed

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

distributed: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m pytest -q -p no:cacheprovider tests/distributed

bench: $(STAMP)
	$(PY) -m benchmarks

# Not in CI (a few minutes): 5,000 steps of SparseDist and SemiSync, RSS sampled.
soak: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) tests/soak/run_soak.py

clean:
	rm -rf $(VENV) build *.egg-info
