# The commands users need: `make test`, `make test-latest` and `make bench`.
# Each builds its venv on first use, then installs this package editable:
#   .venv         the pinned CPU stack (torch 2.13.0 CPU, torchrec 1.8.0)
#   .venv-latest  the current release (torch 2.14.1, torchrec 1.9.2)

PYTHON ?= python3
NPROC ?= 2

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VENV_LATEST := .venv-latest
PY_LATEST := $(VENV_LATEST)/bin/python
STAMP_LATEST := $(VENV_LATEST)/.installed

.PHONY: test unit distributed test-latest unit-latest distributed-latest bench soak clean

# $(call build_stack,venv,requirements,torchrec requirements): torch and
# torchrec's runtime deps first, then torchrec with --no-deps (its metadata asks
# for the CUDA fbgemm-gpu), then this package, then an import check.
define build_stack
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install --quiet --upgrade "pip>=23" "setuptools>=68" wheel
$(1)/bin/python -m pip install --quiet -r $(2)
$(1)/bin/python -m pip install --quiet --no-deps -r $(3)
$(1)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
$(1)/bin/python -c "import torch, torchrec, fbgemm_gpu, trec_pipelines; print('stack ok: torch', torch.__version__, 'torchrec', torchrec.__version__)"
touch $(1)/.installed
endef

$(STAMP): requirements-cpu.txt requirements-torchrec.txt setup.py
	$(call build_stack,$(VENV),requirements-cpu.txt,requirements-torchrec.txt)

$(STAMP_LATEST): requirements-latest.txt requirements-torchrec-latest.txt setup.py
	$(call build_stack,$(VENV_LATEST),requirements-latest.txt,requirements-torchrec-latest.txt)

test: unit distributed

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

distributed: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m pytest -q -p no:cacheprovider tests/distributed

test-latest: unit-latest distributed-latest

unit-latest: $(STAMP_LATEST)
	$(PY_LATEST) -m pytest -q tests/unit

distributed-latest: $(STAMP_LATEST)
	$(VENV_LATEST)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m pytest -q -p no:cacheprovider tests/distributed

bench: $(STAMP)
	$(PY) -m benchmarks

# Not in CI (a few minutes): 5,000 steps of SparseDist and SemiSync, RSS sampled.
soak: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) tests/soak/run_soak.py

clean:
	rm -rf $(VENV) $(VENV_LATEST) build *.egg-info
