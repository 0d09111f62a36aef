#!/usr/bin/env bash
# fp8 store vs bf16 store on the demo model, end to end (docs/export.md "Compact storage"):
# 1. benchmarks/fp8_measure.py on the demo's answers (runs/demo, `make demo` first) and on
#    TEXT_SAMPLES chunks of TEXT_LENGTH tokens of real text: per-state error, teacher agreement,
#    bytes/token of the stores and of every export;
# 2. the same EAGLE-3 drafter trained with speculators' own code on CPU (benchmarks/drafter_cpu.py,
#    in the trainers' venv of tools/interop.sh) on the text set's speculators exports: the bf16
#    store (SEEDS, default 0-3: the yardstick), the fp8 store keeping the teacher (the
#    default rounding) and round to nearest (the same seeds), speculators' fp8 files of the
#    fp8 store and fp8 aux + bf16 final (seed 0); STEPS steps each, all scored on the bf16
#    export's held-out rows too.
# Raw JSON: $RUN/demo/fp8_figures.json, $RUN/text/fp8_figures.json, $RUN/drafter/*.json and
# the summary $RUN/drafter_summary.json.
#   STEPS=1000 bash benchmarks/fp8_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VENV=${INTEROP_VENV:-$HOME/.cache/kimi_pipe/interop-venv}
RUN=${FP8_RUN:-runs/fp8}
STEPS=${STEPS:-1000}
TEXT_SAMPLES=${TEXT_SAMPLES:-256}
TEXT_LENGTH=${TEXT_LENGTH:-256}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
[ -x "$VENV/bin/python" ] || { echo "no trainers' venv at $VENV: run make interop once"; exit 2; }
[ -f runs/demo/records.jsonl ] || { echo "no runs/demo/records.jsonl: run make demo once"; exit 2; }
"$PY" -m benchmarks.fp8_measure --records runs/demo/records.jsonl --out "$RUN/demo"
"$PY" -m benchmarks.fp8_measure --samples "$TEXT_SAMPLES" --length "$TEXT_LENGTH" --out "$RUN/text"
MODEL=$("$PY" -c "from kimi_pipe.config import compose; print(compose(['model=smollm2']).model.hf_weights)")
E="$RUN/text/exports"
# One thread each, JOBS at a time (2 on this 2-core machine: about 8 minutes a pair when the
# machine is otherwise quiet); the figures compared (held-out loss and accuracy) do not depend
# on time. Every drafter is also scored on the bf16 export's held-out rows (--eval-export): one
# teacher for all. SEEDS bf16 seeds make the yardstick; each fp8 store gets the same seeds.
drafter() {  # NAME EXPORT SEED
  "$VENV/bin/python" -m benchmarks.drafter_cpu --export "$2" --verifier "$MODEL" --seed "$3" \
    --steps "$STEPS" --threads 1 --eval-export "$E/bf16/speculators" \
    --out "$RUN/drafter/$1.json" > "$RUN/drafter/$1.log" 2>&1
}
export -f drafter
export VENV MODEL STEPS E RUN
mkdir -p "$RUN/drafter"
{
  for s in ${SEEDS:-0 1 2 3}; do
    echo "bf16-seed$s $E/bf16/speculators $s"
    echo "fp8keepteacher-seed$s $E/fp8_keep_teacher/speculators $s"
    echo "fp8store-seed$s $E/fp8/speculators $s"
  done
  echo "fp8auxbf16final-seed0 $E/fp8_aux_bf16_final/speculators 0"
  echo "fp8files-seed0 $E/fp8/speculators_fp8 0"
} | xargs -P "${JOBS:-2}" -L 1 bash -c 'drafter "$0" "$1" "$2"'
"$PY" -m benchmarks.drafter_summary "$RUN/drafter" --out "$RUN/drafter_summary.json"
