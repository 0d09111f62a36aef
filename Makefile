# kimi_pipe: every target sets up the virtual environment first (pinned, hashed lock).
#   make demo                      # the whole pipeline offline on a bundled small model
#   make run pipeline=openrouter_sglang dataset=B5 budget.usd=20 extract.model_path=DIR
#   make test                      # the test suite (CI runs exactly this)
#   make generate dataset=B5 budget.usd=20 provider.concurrency=64
#   make sweep dataset=B5 providers=a,b,c n=50 usd=6
# Python 3.11, 3.12 or 3.13: PY=python3.12 (or a path) picks one, else the first that runs
# (on PATH, then pyenv's installed versions: a pyenv shim of an unselected version fails).
SUPPORTED_PY := python3.11 python3.12 python3.13 \
	$(sort $(wildcard $(HOME)/.pyenv/versions/3.1[123].*/bin/python3.1[123]))
ifndef PY
PY := $(firstword $(foreach p,$(SUPPORTED_PY),$(shell command -v $(p) >/dev/null 2>&1 && $(p) -c 'import sys' >/dev/null 2>&1 && echo $(p))))
endif
# torch: cpu (PyTorch's CPU index, the default), cuda (a GPU host: PyPI's CUDA build) or
# none (the host provides torch itself, e.g. a CUDA image's; the venv then sees system packages).
TORCH ?= cpu
ifeq ($(filter cpu cuda none,$(TORCH)),)
$(error TORCH=$(TORCH): use cpu, cuda or none)
endif
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
TORCH_LOCK := $(if $(filter-out none,$(TORCH)),requirements-torch-$(TORCH).lock)
STAMP := $(VENV)/.installed-$(TORCH)-$(shell cat requirements.lock $(TORCH_LOCK) pyproject.toml setup.py 2>/dev/null | sha256sum | cut -c1-12)
PY_OK := import sys; v = sys.version_info[:2]; sys.exit(0 if (3, 11) <= v <= (3, 13) else 1)

# Settings typed on make's command line go to the stage as they are: every `name=value` whose
# name has a lowercase letter (`make generate dataset=B5 budget.usd=5`, `make demo
# dataset.limit=4`, `'sweep.providers=[a,b]'`) is a Hydra override of the target's stage, in
# the order of their names; a stage refuses an unknown one by name. Names in capitals only are
# make's and the environment's (PY, TORCH, ARGS, KIMI_TOKENIZER_DIR). A target's short names
# (sweep's providers, n, usd) are translated by the target and not passed on as they are.
UPPERCASE = $(subst a,A,$(subst b,B,$(subst c,C,$(subst d,D,$(subst e,E,$(subst f,F,$(subst g,G,$(subst \
	h,H,$(subst i,I,$(subst j,J,$(subst k,K,$(subst l,L,$(subst m,M,$(subst n,N,$(subst o,O,$(subst \
	p,P,$(subst q,Q,$(subst r,R,$(subst s,S,$(subst t,T,$(subst u,U,$(subst v,V,$(subst w,W,$(subst \
	x,X,$(subst y,Y,$(subst z,Z,$(1)))))))))))))))))))))))))))
SETTINGS_GIVEN := $(sort $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),\
	$(if $(filter-out $(call UPPERCASE,$(v)),$(v)),$(v)))))
# The targets that run a stage (each takes settings); any other target given one refuses it.
STAGE_TARGETS := demo run generate sweep probe report reconstruct-sample
ifneq ($(SETTINGS_GIVEN),)
NOT_A_STAGE := $(filter-out $(STAGE_TARGETS) setup,$(MAKECMDGOALS))
ifeq ($(filter $(STAGE_TARGETS),$(MAKECMDGOALS)),)
NOT_A_STAGE := $(or $(MAKECMDGOALS),setup)
endif
ifneq ($(NOT_A_STAGE),)
$(error make $(NOT_A_STAGE) runs no stage and takes no settings: $(SETTINGS_GIVEN) (settings go to \
	$(STAGE_TARGETS); make's own variables are in capitals: PY=, TORCH=))
endif
endif
# settings_except(short names): the settings given, each one shell word, less the short names.
QUOTE = '$(subst ','\'',$(1))'
settings_except = $(foreach v,$(filter-out $(1),$(SETTINGS_GIVEN)),$(call QUOTE,$(v)=$(value $(v))))
SETTINGS = $(call settings_except,)

.PHONY: setup test lint snapshots reconstruct-sample yield generate sweep probe report demo run bench interop sglang-cpu test-sglang-cpu lock lock-torch wheel check-install clean

setup: $(STAMP)

$(STAMP): requirements.lock $(TORCH_LOCK) pyproject.toml setup.py
	@test -n "$(PY)" || { echo "error: no Python 3.11, 3.12 or 3.13 found (tried $(SUPPORTED_PY)); install one or run make PY=/path/to/python3.12"; exit 2; }
	@$(PY) -c '$(PY_OK)' 2>/dev/null || { echo "error: PY=$(PY) is not Python 3.11-3.13 ($$($(PY) --version 2>&1)); run make PY=/path/to/python3.12"; exit 2; }
	@if test -x $(PYTHON) && [ "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])')" != "$$($(PY) -c 'import sys; print(sys.version_info[:2])')" ]; then \
	  echo "$(VENV) was made with another Python than $(PY): making it again"; rm -rf $(VENV); fi
	@if test -f $(VENV)/pyvenv.cfg && [ "$$(grep -c 'include-system-site-packages = true' $(VENV)/pyvenv.cfg)" != "$(if $(filter none,$(TORCH)),1,0)" ]; then \
	  echo "$(VENV) sees $(if $(filter none,$(TORCH)),no,the) system packages; TORCH=$(TORCH) wants the opposite: making it again"; rm -rf $(VENV); fi
	@echo "setup: $$($(PY) --version) in $(VENV), torch from $(or $(TORCH_LOCK),the host (TORCH=none))"
	test -x $(PYTHON) || $(PY) -m venv $(if $(filter none,$(TORCH)),--system-site-packages) $(VENV)
	$(PYTHON) -m pip install --quiet --require-hashes --no-deps -r requirements.lock
	$(if $(TORCH_LOCK),$(PYTHON) -m pip install --quiet --require-hashes --no-deps -r $(TORCH_LOCK))
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

# The suite runs on up to 4 cores (pytest-xdist), a test file per worker so that a file's
# fixtures (fake servers, corpora) are built once; JOBS=1 runs it in one process.
JOBS ?= $(shell $(or $(PY),python3) -c 'import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))' 2>/dev/null || echo 1)
test: setup
	$(PYTHON) -m pytest -q $(if $(filter-out 0 1,$(JOBS)),-n $(JOBS) --dist loadfile)

# The gates CI runs besides the tests: lint, one formatter, and the type checker (pinned).
lint: setup
	$(BIN)/ruff check kimi_pipe tests benchmarks tools
	$(BIN)/ruff format --check kimi_pipe tests benchmarks tools
	$(BIN)/mypy

# Regenerate the golden token-id snapshots; review the diff like code.
snapshots: setup
	rm -f snapshots/test_snapshots/*.txt
	$(PYTHON) -m pytest -q tests/test_snapshots.py --snapshot-update

# Reconstruct the bundled recorded answers with the Kimi tokenizer (../shared or KIMI_TOKENIZER_DIR).
yield: setup
	$(PYTHON) -m benchmarks.yield_table

reconstruct-sample: setup
	$(PYTHON) -m kimi_pipe reconstruct model=kimi_k25 \
	  input=tests/fixtures/kimi_k25_responses.jsonl output=runs/sample/reconstructed.jsonl $(SETTINGS)

# The whole pipeline offline on SmolLM2 (docs/demo.md); settings as they are:
#   make demo dataset.limit=4 provider.params.max_tokens=16
demo: setup
	$(PYTHON) -m kimi_pipe demo $(SETTINGS) $(ARGS)

# A whole job from conf/pipeline/NAME.yaml (demo, openrouter_sglang, sweep); a second run skips
# finished stages and resumes a half-done one.
run: setup
	$(PYTHON) -m kimi_pipe run $(SETTINGS) $(ARGS)

generate: setup
	$(PYTHON) -m kimi_pipe generate $(SETTINGS) $(ARGS)

# Provider sweep (docs/sweep.md): one generate job per OpenRouter provider on the same n
# prompts, sharing one budget, then runs/sweep/<dataset>/report.md with charts.
#   make sweep dataset=B5 providers=moonshotai,fireworks,novita n=50 usd=6
# The short names are the sweep group's settings (conf/sweep/default.yaml): sweep.providers=[...].
sweep: setup
	$(PYTHON) -m kimi_pipe sweep $(if $(providers),'sweep.providers=[$(providers)]') \
	  $(if $(n),sweep.n=$(n)) $(if $(usd),sweep.usd=$(usd)) $(call settings_except,providers n usd) $(ARGS)

# Conformance probes (docs/provider-truth.md): conf/probes/<model>.yaml pinned to each provider,
# then runs/probe/conformance.md.   make probe providers=moonshotai,fireworks [usd=0.3]
probe: setup
	$(PYTHON) -m kimi_pipe probe $(if $(providers),'probe.providers=[$(providers)]') $(if $(usd),probe.usd=$(usd)) \
	  $(call settings_except,providers usd) $(ARGS)

# Report over finished runs: make report sweep_dir=runs/sweep/B5 (a single run dir works too)
report: setup
	$(PYTHON) -m kimi_pipe report $(if $(sweep_dir),report.sweep_dir=$(sweep_dir)) \
	  $(call settings_except,sweep_dir) $(ARGS)

bench: setup
	$(PYTHON) -m benchmarks.bench_reconstruct
	$(PYTHON) -m benchmarks.bench_generate

# Every export format loaded by the trainers' own code (SpecForge, speculators, ModelOpt from
# PyPI, in their own venv), with numeric checks; figures in README (docs/export.md).
interop: setup
	PY=$(PYTHON) bash tools/interop.sh

# SGLang's real engine on this CPU (Intel Xeon with AMX, or AVX2 with SGLang's torch-native
# paths), in its own venv .venv-sglang; the CPU kernel is compiled once from SGLang's sources
# (SGLANG_SRC=a clone or an archive of them, else ../shared/sglang/) and cached in ~/.cache/kimi_pipe.
sglang-cpu:
	bash tools/sglang_cpu/setup.sh

# The sglang_cpu tier: extract=sglang extract.device=cpu against extract=hf on every record of the
# demo (made first with `make demo` when missing), target resolution and the split check through
# SGLang, the trainers' loaders on its export (their venv, as `make interop` makes it), SGLang
# engines as Ray actors (two, one killed; one engine over two nodes, and losing one) and over
# two submitit tasks; figures in runs/sglang_cpu/. Here nothing skips: a missing piece fails
# (KIMI_PIPE_SGLANG_CPU=1).
SGLANG_DEMO_ARGS ?=
test-sglang-cpu: setup
	@test -x .venv-sglang/bin/python || { echo "error: .venv-sglang missing: run make sglang-cpu first"; exit 2; }
	test -f runs/demo/records.jsonl || $(PYTHON) -m kimi_pipe demo $(SGLANG_DEMO_ARGS)
	INTEROP_VENV_ONLY=1 bash tools/interop.sh
	KIMI_PIPE_SGLANG_CPU=1 .venv-sglang/bin/python -m pytest -q -s -p no:cacheprovider -m sglang_cpu tests/test_sglang_cpu.py

# Locks (uv, from PyPI): one universal requirements.lock for Python 3.11-3.13 and Linux,
# with torch's own dependencies but not torch (its metadata comes from PyTorch's CPU index,
# or from this machine's copy of the same wheel in /opt/wheels when that folder exists).
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
UV_COMPILE := $(PYTHON) -m uv pip compile --generate-hashes --universal --python-version 3.11 \
	  --no-header --index-url https://pypi.org/simple
TORCH_METADATA := $(if $(wildcard /opt/wheels/torch-*.whl),--find-links /opt/wheels,\
	  --extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match)

# The current lock is each compile's starting point (uv's -o preferences): a new pin moves
# only what it needs, not every package with a newer release.
lock: setup
	cp requirements.lock requirements.lock.deps && cp requirements.lock requirements.lock.nodeps
	$(UV_COMPILE) $(TORCH_METADATA) --no-emit-package torch -q -o requirements.lock.deps requirements.in
	$(UV_COMPILE) --no-deps -q -o requirements.lock.nodeps requirements-nodeps.in
	cat requirements.lock.deps requirements.lock.nodeps > requirements.lock.new
	rm requirements.lock.deps requirements.lock.nodeps
	mv requirements.lock.new requirements.lock

# torch's two locks. The CPU one needs PyTorch's index to be reachable (the machines this
# project was built on reach only PyPI: there the file holds the hashes that index publishes,
# and the local wheel's sha256 equals the cp311 one; docs/install.md). The index line is
# written into the file so that pip and uv look there for torch.
lock-torch: setup
	{ echo "--extra-index-url $(TORCH_CPU_INDEX)"; \
	  $(UV_COMPILE) --no-deps --extra-index-url $(TORCH_CPU_INDEX) requirements-torch-cpu.in; \
	} > requirements-torch-cpu.lock.new
	mv requirements-torch-cpu.lock.new requirements-torch-cpu.lock
	$(UV_COMPILE) --constraint requirements.lock requirements-torch-cuda.in > requirements-torch-cuda.lock.new
	mv requirements-torch-cuda.lock.new requirements-torch-cuda.lock

# The wheel a user installs (configs and demo prompts inside): dist/kimi_pipe-*.whl
wheel: setup
	rm -rf dist build
	$(PYTHON) -m pip wheel --quiet --no-deps --no-build-isolation -w dist .

# Install the wheel like a user (fresh venv outside the checkout, INSTALL_PY, default
# Python 3.12) and run `kimi-pipe reconstruct` on the bundled sample from another directory.
check-install: wheel
	$(PYTHON) -m tools.check_install --python $(or $(INSTALL_PY),3.12) --wheel-dir dist

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build dist
