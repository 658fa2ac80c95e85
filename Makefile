# The commands users need: `make test`, `make test-latest` and `make bench`.
# Each builds its venv on first use, then installs this package editable:
#   .venv         the pinned CPU stack (torch 2.13.0 CPU, torchrec 1.8.0)
#   .venv-latest  the current release (torch 2.14.1, torchrec 1.9.2)
#   .venv-oldest  the oldest supported release (torch 2.12.0, torchrec 1.7.0):
#                 `make test-oldest`, the unit and 2-rank tiers

# The interpreter each stack's venv is made with: PYTHON for all of them, or
# PYTHON_PINNED / PYTHON_LATEST for one stack (CI runs the pinned stack on 3.11,
# where its CPU torch wheel is on disk, and the current release on 3.10, the
# oldest Python supported).  An existing venv is kept: `make clean` first to
# change a stack's Python.
PYTHON ?= python3
PYTHON_PINNED ?= $(PYTHON)
PYTHON_LATEST ?= $(PYTHON)
PYTHON_OLDEST ?= $(PYTHON)
NPROC ?= 2

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VENV_LATEST := .venv-latest
PY_LATEST := $(VENV_LATEST)/bin/python
STAMP_LATEST := $(VENV_LATEST)/.installed

VENV_OLDEST := .venv-oldest
PY_OLDEST := $(VENV_OLDEST)/bin/python
STAMP_OLDEST := $(VENV_OLDEST)/.installed

VENV_GPU := .venv-gpu
STAMP_GPU := $(VENV_GPU)/.installed

.PHONY: venv venv-latest venv-oldest test-oldest unit-oldest distributed-oldest test unit distributed distributed-4 test-latest unit-latest distributed-latest distributed-4-latest lint docs test-gpu gpu-suite bench bench-agreement wheel soak clean

# $(call build_stack,venv,requirements,torchrec requirements,python): the venv
# made with that Python, the stack's test requirements (which include its
# runtime ones, requirements-runtime*.txt, with -r: torch, fbgemm and
# torchrec's runtime deps) first, then torchrec
# with --no-deps (its metadata asks for the CUDA fbgemm-gpu), then this package,
# then an import check.
define build_stack
test -x $(1)/bin/python || $(4) -m venv $(1)
$(1)/bin/python -m pip install --quiet --upgrade "pip>=23" "setuptools>=68" wheel
$(1)/bin/python -m pip install --quiet -r $(2)
$(1)/bin/python -m pip install --quiet --no-deps -r $(3)
$(1)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
$(1)/bin/python -c "import sys, torch, torchrec, fbgemm_gpu, trec_pipelines; print('stack ok: Python', sys.version.split()[0], 'torch', torch.__version__, 'torchrec', torchrec.__version__)"
touch $(1)/.installed
endef

$(STAMP): requirements-cpu.txt requirements-runtime.txt requirements-torchrec.txt setup.py
	$(call build_stack,$(VENV),requirements-cpu.txt,requirements-torchrec.txt,$(PYTHON_PINNED))

$(STAMP_LATEST): requirements-latest.txt requirements-runtime-latest.txt requirements-torchrec-latest.txt setup.py
	$(call build_stack,$(VENV_LATEST),requirements-latest.txt,requirements-torchrec-latest.txt,$(PYTHON_LATEST))

$(STAMP_OLDEST): requirements-oldest.txt requirements-runtime-oldest.txt requirements-torchrec-oldest.txt setup.py
	$(call build_stack,$(VENV_OLDEST),requirements-oldest.txt,requirements-torchrec-oldest.txt,$(PYTHON_OLDEST))

$(STAMP_GPU): requirements-gpu.txt requirements-runtime-gpu.txt requirements-torchrec-latest.txt setup.py
	$(call build_stack,$(VENV_GPU),requirements-gpu.txt,requirements-torchrec-latest.txt,$(PYTHON))

# Each stack's venv alone (CI builds .venv-latest while the pinned stack tests).
venv: $(STAMP)
venv-latest: $(STAMP_LATEST)
venv-oldest: $(STAMP_OLDEST)

# The two CPU stacks test on the CPU even on a GPU host (their fbgemm is the CPU
# build); `make test-gpu` has a stack of its own.
unit distributed distributed-4 unit-latest distributed-latest distributed-4-latest unit-oldest distributed-oldest: export TREC_DEVICE = cpu

test: unit distributed distributed-4

unit: $(STAMP)
	$(PY) -m pytest -q -n $(NPROC) --dist worksteal tests/unit

distributed: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m pytest -q -p no:cacheprovider tests/distributed

# 4 ranks as two simulated hosts of 2 ranks each (local world size 2): uneven
# all-to-all splits and more than one peer.  Two torchrun agents on this
# machine meet at DIST4_PORT.  All of the tier but test_comp_autograd.py: its
# compile tolerance holds at 2 ranks only (a sum of two gradients is exact in
# any order, of four it is not), and it is the slowest file.
DIST4_PORT ?= 29517
DIST4_TESTS ?= $(filter-out tests/distributed/test_comp_autograd.py,$(wildcard tests/distributed/test_*.py))
# DIST4_SHARD=k/n runs the k-th of n disjoint parts of the 4-rank tier (by a
# hash of each test's id; empty: all of it).  DIST4_TESTS= (empty) runs
# nothing: .ci/run runs the tier on the pinned stack only (make test-latest
# DIST4_TESTS=); every test runs on 2 ranks on every stack there.
DIST4_SHARD ?=

# $(call run_4_ranks,venv): both agents of the 4-rank world; the second's tail is
# shown, and when either failed its last 60 lines, its whole output kept in
# .distributed-4.host1.log.
define run_4_ranks
@if [ -z "$(strip $(DIST4_TESTS))" ]; then \
	echo "4-rank tier: DIST4_TESTS is empty, nothing to run"; exit 0; fi; \
	export TREC_TEST_SHARD="$(DIST4_SHARD)"; \
	agent="$(1)/bin/torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d \
	--rdzv_endpoint=localhost:$(DIST4_PORT) --rdzv_id=trec-dist4 \
	-m pytest -q -p no:cacheprovider $(DIST4_TESTS)"; \
	$$agent > .distributed-4.host1.log 2>&1 & host1=$$!; \
	rc=0; $$agent || rc=$$?; wait $$host1 || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
	echo "--- second host:"; tail -n 5 .distributed-4.host1.log; rm -f .distributed-4.host1.log; \
	else echo "--- second host (all of it in .distributed-4.host1.log):"; \
	tail -n 60 .distributed-4.host1.log; fi; exit $$rc
endef

distributed-4: $(STAMP)
	$(call run_4_ranks,$(VENV))

test-latest: unit-latest distributed-latest distributed-4-latest

unit-latest: $(STAMP_LATEST)
	$(PY_LATEST) -m pytest -q -n $(NPROC) --dist worksteal tests/unit

distributed-latest: $(STAMP_LATEST)
	$(VENV_LATEST)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m pytest -q -p no:cacheprovider tests/distributed

distributed-4-latest: $(STAMP_LATEST)
	$(call run_4_ranks,$(VENV_LATEST))

# The oldest supported torchrec: the unit tier (the API-parity test reads this
# torchrec) and the whole 2-rank tier.  OLDEST_TESTS= a few files runs part of
# it, e.g. the files that build and subclass torchrec's classes as outside code
# does: tests/distributed/test_upstream_sparse_dist.py
# tests/distributed/test_outside_subclasses.py tests/distributed/test_framework_subclasses.py
OLDEST_TESTS ?= tests/distributed

test-oldest: unit-oldest distributed-oldest

unit-oldest: $(STAMP_OLDEST)
	$(PY_OLDEST) -m pytest -q -n $(NPROC) --dist worksteal tests/unit

distributed-oldest: $(STAMP_OLDEST)
	$(VENV_OLDEST)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m pytest -q -p no:cacheprovider $(OLDEST_TESTS)

# The whole suite on this host's NVIDIA GPUs: TREC_DEVICE=cuda (trec_pipelines/testing/devices.py)
# puts every rank on its GPU with NCCL, and the torchrec CPU shims are off.  One
# rank per GPU; the distributed tier needs two GPUs or more.  Without a GPU it
# says so in one line and runs nothing (nor builds .venv-gpu).  Never yet run on
# a GPU: this project has had none.
GPU_COUNT = $$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

test-gpu:
	@if [ "$(GPU_COUNT)" -lt 1 ]; then \
		echo "make test-gpu: no GPU on this host (nvidia-smi lists none); nothing run"; \
	else $(MAKE) --no-print-directory gpu-suite; fi

gpu-suite: $(STAMP_GPU)
	TREC_DEVICE=cuda $(VENV_GPU)/bin/python -m pytest -q -n $(NPROC) tests/unit
	@n=$(GPU_COUNT); if [ "$$n" -lt 2 ]; then \
		echo "make test-gpu: 1 GPU: the distributed tier needs 2 (one rank per GPU); not run"; \
	else TREC_DEVICE=cuda $(VENV_GPU)/bin/torchrun --standalone --nproc_per_node=$$n \
		-m pytest -q -p no:cacheprovider tests/distributed; fi

# Static checks: ruff (lint, and the format check) on the whole repository
# (ruff.toml), and mypy --strict on trec_pipelines/ (mypy.ini) with each stack's
# Python, since the torchrec it reads types from differs between them.
lint: $(STAMP) $(STAMP_LATEST)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV_LATEST)/bin/mypy

# The documentation site (Sphinx + MyST, docs/), warnings as errors, from scratch.
# Built by the pinned stack: Sphinx 9 and MyST 5 need Python 3.11 or newer, and
# that stack's requirements install them only there (CI runs the current release
# on 3.10).
docs: $(STAMP)
	@$(PY) -c "import sphinx, myst_parser" 2>/dev/null || { echo "make docs: .venv has no Sphinx:" \
		"its Python is older than 3.11, which Sphinx 9 needs; make clean, then make docs" \
		"PYTHON_PINNED=python3.11 (or newer)" >&2; exit 1; }
	rm -rf docs/_build
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

# A wheel and an sdist in dist/, then the wheel installed alone (no deps, into a
# scratch directory) and imported by each stack's Python from outside the repo:
# what a user's `pip install` gets, not the editable checkout.
wheel: $(STAMP) $(STAMP_LATEST)
	rm -rf dist
	$(PY) -m build --no-isolation --sdist --wheel --outdir dist .
	@for venv in $(VENV) $(VENV_LATEST); do \
		scratch=$$(mktemp -d); \
		$$venv/bin/python -m pip install --quiet --no-deps --target $$scratch dist/*.whl || exit 1; \
		(cd $$scratch && PYTHONPATH=$$scratch $(CURDIR)/$$venv/bin/python -c \
			"import sys, trec_pipelines as t; assert t.__file__.startswith(sys.argv[1]), t.__file__; \
			print('$$venv: wheel imports', t.__version__, 'from', t.__file__)" $$scratch) || exit 1; \
		rm -rf $$scratch; \
	done

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

# What the ranks' agreement on each batch costs a SparseDist step (a minute or two).
bench-agreement: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m benchmarks.measuring.agreement_cost

# Not in CI (a few minutes): 5,000 steps of SparseDist and SemiSync, RSS sampled.
soak: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) tests/soak/run_soak.py

clean:
	rm -rf $(VENV) $(VENV_LATEST) $(VENV_OLDEST) $(VENV_GPU) build *.egg-info
