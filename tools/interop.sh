#!/usr/bin/env bash
# make interop: export the demo's hidden states in every trainer format and load each export
# with the trainer's OWN data-loading code (SpecForge, speculators, ModelOpt from PyPI), with
# numeric checks (tools/interop_check.py). About 8 minutes on 2 CPU cores, model cached.
#   INTEROP_RUN=runs/interop INTEROP_VENV=~/.cache/kimi_pipe/interop-venv bash tools/interop.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BASE_PY=${INTEROP_BASE_PYTHON:-python3.11}
VENV=${INTEROP_VENV:-$HOME/.cache/kimi_pipe/interop-venv}
RUN=${INTEROP_RUN:-runs/interop}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

# 1. The trainers' environment. Their pins disagree with each other (SpecForge 0.2.0 wants
# torch 2.11 / transformers 5.8.1, speculators transformers <= 5.19) and with ours, so they get
# their own venv; only their data-loading code runs, which these versions serve.
STAMP="$VENV/.interop-v3"  # v3: loguru (speculators.train.cli imports it)
if [ ! -f "$STAMP" ]; then
  "$BASE_PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 datasets==5.1.0 transformers==5.19.0 \
    safetensors==0.8.0 pydantic==2.14.4 openai==3.57.0 httpx==0.28.1 requests==2.34.2 \
    PyYAML==6.0.4 omegaconf==2.4.0 PuLP==3.3.2 scipy==1.17.1 pydantic-settings==2.16.3 \
    loguru==0.7.3
  "$VENV/bin/pip" install -q --no-deps specforge==0.2.0 speculators==0.9.0 \
    hs-connectors==0.9.0 nvidia-modelopt==0.47.0
  touch "$STAMP"
fi
[ -z "${INTEROP_VENV_ONLY:-}" ] || exit 0  # make test-sglang-cpu: only the trainers' venv

# 2. Demo data: 8 prompts, up to 64 answer tokens, greedy, real SmolLM2 weights. The demo's
# store (hidden_hf) is pre-norm with its final norm (the extract default), in bf16 (the exactness
# checks and speculators' fp8 files are made from bf16 states); hidden_post is the
# same records extracted post-norm (for the disk and exactness figures and a refusal),
# hidden_fp8 the same records in fp8, the final state rounded to keep the teacher (the
# default extract.final_fp8_rounding=keep_teacher; held to bf16's teacher floor: round to
# nearest gave 94.6 % = next token here against 99.66 %; docs/export.md, "Compact storage").
# Stores and exports are made afresh: a store made under other settings would be refused.
rm -rf "$RUN/hidden_hf" "$RUN/hidden_post" "$RUN/hidden_fp8" "$RUN/interop"
"$PY" -m kimi_pipe demo dataset.limit=8 provider.params.max_tokens=64 "output_dir=$RUN" \
  extract.store_dtype=bfloat16
"$PY" -m kimi_pipe extract model=smollm2 "extract.run_dir=$RUN" extract.only_ok=false \
  extract.store_dtype=bfloat16 \
  extract.final_state=post_norm "extract.output_dir=$RUN/hidden_post" "hydra.run.dir=$RUN"
"$PY" -m kimi_pipe extract model=smollm2 "extract.run_dir=$RUN" extract.only_ok=false \
  extract.store_dtype=fp8_e4m3 \
  "extract.output_dir=$RUN/hidden_fp8" "hydra.run.dir=$RUN"
MODEL=$("$PY" -c "from kimi_pipe.config import compose; print(compose(['model=smollm2']).model.hf_weights)")

# 3. Exports (project code), 4. checks (trainers' code, never imports kimi_pipe).
"$PY" -m tools.interop_export --run "$RUN" --out "$RUN/interop"
"$VENV/bin/python" -m tools.interop_check --exports "$RUN/interop" \
  --records "$RUN/records.jsonl" --model "$MODEL"
