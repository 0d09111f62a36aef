# kimi_pipe: every target sets up the virtual environment first (pinned, hashed lock).
#   make demo                      # the whole pipeline offline on a bundled small model
#   make run pipeline=openrouter_sglang ARGS="dataset=B5 budget.usd=20 extract.model_path=DIR"
#   make test                      # the test suite (CI runs exactly this)
#   make generate dataset=B5 ARGS="budget.usd=20 provider.concurrency=64"
#   make sweep dataset=B5 providers=a,b,c n=50 usd=6
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | sha256sum | cut -c1-12)

.PHONY: setup test lint snapshots reconstruct-sample generate sweep probe report demo run bench lock clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found; install Python 3.11 or run make PY=/path/to/python3.11"; exit 2; }
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --require-hashes --no-deps -r requirements.lock
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

test: setup
	$(PYTHON) -m pytest -q

lint: setup
	$(BIN)/ruff check kimi_pipe tests scripts

# Regenerate the golden token-id snapshots; review the diff like code.
snapshots: setup
	rm -f snapshots/test_snapshots/*.txt
	$(PYTHON) -m pytest -q tests/test_snapshots.py --snapshot-update

# Reconstruct the bundled recorded answers with the Kimi tokenizer (../shared or KIMI_TOKENIZER_DIR).
reconstruct-sample: setup
	$(PYTHON) -m kimi_pipe.reconstruct model=kimi_k25 \
	  input=tests/fixtures/kimi_k25_responses.jsonl output=runs/sample/reconstructed.jsonl

# The whole pipeline offline on SmolLM2 (docs/demo.md); config overrides in ARGS.
demo: setup
	$(PYTHON) -m kimi_pipe.demo $(ARGS)

# A whole job from conf/pipeline/NAME.yaml (demo, openrouter_sglang, sweep); a second run skips
# finished stages and resumes a half-done one.
run: setup
	$(PYTHON) -m kimi_pipe.run pipeline=$(pipeline) $(ARGS)

generate: setup
	$(PYTHON) -m kimi_pipe.generate $(if $(dataset),dataset=$(dataset)) $(ARGS)

# Provider sweep (docs/sweep.md): one generate job per OpenRouter provider on the same n
# prompts, sharing one budget, then runs/sweep/<dataset>/report.md with charts.
#   make sweep dataset=B5 providers=moonshotai,fireworks,novita n=50 usd=6
sweep: setup
	$(PYTHON) -m kimi_pipe.sweep dataset=$(dataset) providers=$(providers) n=$(or $(n),50) $(if $(usd),usd=$(usd)) $(ARGS)

# Conformance probes (docs/provider-truth.md): conf/probes/<model>.yaml pinned to each provider,
# then runs/probe/conformance.md.   make probe providers=moonshotai,fireworks [usd=0.3]
probe: setup
	$(PYTHON) -m kimi_pipe.probe providers=$(providers) $(if $(usd),usd=$(usd)) $(ARGS)

# Report over finished runs: make report sweep_dir=runs/sweep/B5 (a single run dir works too)
report: setup
	$(PYTHON) -m kimi_pipe.report sweep_dir=$(sweep_dir) $(ARGS)

bench: setup
	$(PYTHON) scripts/bench_reconstruct.py
	$(PYTHON) scripts/bench_generate.py

UV_COMPILE := $(PYTHON) -m uv pip compile --generate-hashes --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 --find-links /opt/wheels --no-header

lock:
	{ $(UV_COMPILE) requirements.in && $(UV_COMPILE) --no-deps requirements-nodeps.in; } > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
