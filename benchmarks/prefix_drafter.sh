#!/usr/bin/env bash
# Issue 33's drafter figure: the same EAGLE-3 drafter (speculators 0.9.0's own code on CPU,
# benchmarks/drafter_cpu.py in the trainers' venv of tools/interop.sh, as in fp8_check.sh)
# trained on the default accept set with and without `prefix_proven`, every drafter scored on
# the same held-out rows.
# 1. benchmarks/prefix_drafter_sets.py splits the final records of
#    benchmarks/calibrate_resolution.py (--records-out; RECORDS: one file per --part) into a
#    held-out set (every 5th distinct prompt held out whole: its text_proven / target_resolved
#    answers; a rule that does not look at any arm) and a training set (the other prompts'
#    records, evidence as the calibration left it: resolved, split-checked, prefixes checked);
# 2. the project's own stages: `kimi_pipe extract` (hf backend, model=smollm2, bf16 states,
#    resolve.enabled=false: the records are already resolved and checked, not rescored) makes
#    one store of each set; `kimi_pipe export format=speculators` makes the two arms from the
#    one training store, differing only in export.accept (prefix: text_proven,
#    target_resolved, prefix_proven, the default set less engine_ids, which this stack never
#    gives; noprefix: the same without prefix_proven), and the held-out export;
# 3. SEEDS drafters per arm (noprefix-seed*: the yardstick), STEPS steps of SEQ_LEN packed
#    tokens, each trained on every row of its arm and scored on every held-out row
#    (drafter_cpu.py --heldout-export), JOBS at a time, one thread each;
# 4. benchmarks/drafter_summary.py --yardstick noprefix-seed --by-arm.
# Raw JSON: $RUN/sets.json, $RUN/drafter/*.json, $RUN/drafter_summary.json, the exports' own
# export_summary.json; with MEASURED=DIR, copied there (docs/measured/prefix_drafter/).
# STEPS 350 x SEQ_LEN 256 (the committed run): at most 3.4 passes over the prefix arm's 26,646
# tokens; 0.75 s a step on one free core (about 4.5 minutes a drafter), twice that when two
# share a core with other jobs. The committed run (docs/measured/prefix_drafter/) has seeds
# 0-2: seeds 0 and 1 from this script, seed 2 of both arms afterwards with the same
# drafter_cpu.py command lines on the same exports, then the same summary.
#   RECORDS="runs/calib/records-part0.jsonl runs/calib/records-part1.jsonl" \
#       MEASURED=docs/measured/prefix_drafter bash benchmarks/prefix_drafter.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VENV=${INTEROP_VENV:-$HOME/.cache/kimi_pipe/interop-venv}
RUN=${PREFIX_RUN:-runs/prefix_drafter}
STEPS=${STEPS:-350}
SEQ_LEN=${SEQ_LEN:-256}
SEEDS=${SEEDS:-0 1 2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
[ -x "$VENV/bin/python" ] || { echo "no trainers' venv at $VENV: run make interop once"; exit 2; }
[ -n "${RECORDS:-}" ] || { echo "RECORDS: calibrate_resolution.py --records-out file(s)"; exit 2; }
# shellcheck disable=SC2086  # RECORDS is a list of paths
"$PY" -m benchmarks.prefix_drafter_sets --records $RECORDS --out "$RUN"

WHOLE="text_proven,target_resolved"
extract() {  # SET ACCEPT: one store per set, the two sets side by side (one thread each)
  rm -rf "$RUN/$1/hidden_hf"
  "$PY" -m kimi_pipe extract model=smollm2 "extract.records=$RUN/$1/records.jsonl" \
    "extract.accept=$2" extract.store_dtype=bfloat16 extract.threads=1 \
    resolve.enabled=false "extract.output_dir=$RUN/$1/hidden_hf" "hydra.run.dir=$RUN/$1" \
    > "$RUN/$1/extract.log" 2>&1
}
extract train "[$WHOLE,prefix_proven]" &
TRAIN=$!
extract heldout "[$WHOLE]" || { wait "$TRAIN"; tail "$RUN/heldout/extract.log"; exit 1; }
wait "$TRAIN" || { tail "$RUN/train/extract.log"; exit 1; }
grep -h "^\[extract\]" "$RUN/train/extract.log" "$RUN/heldout/extract.log"
E="$RUN/exports"
rm -rf "$E"
"$PY" -m kimi_pipe export format=speculators "stores=[$RUN/train/hidden_hf]" seed=0 \
  "output=$E/prefix" "export.accept=[$WHOLE,prefix_proven]" "hydra.run.dir=$E"
"$PY" -m kimi_pipe export format=speculators "stores=[$RUN/train/hidden_hf]" seed=0 \
  "output=$E/noprefix" "export.accept=[$WHOLE]" "hydra.run.dir=$E"
"$PY" -m kimi_pipe export format=speculators "stores=[$RUN/heldout/hidden_hf]" seed=0 \
  "output=$E/heldout" "export.accept=[$WHOLE]" "hydra.run.dir=$E"

MODEL=$("$PY" -c "from kimi_pipe.config import compose; print(compose(['model=smollm2']).model.hf_weights)")
drafter() {  # NAME EXPORT SEED
  "$VENV/bin/python" -m benchmarks.drafter_cpu --export "$2" --verifier "$MODEL" --seed "$3" \
    --steps "$STEPS" --seq-len "$SEQ_LEN" --threads 1 --heldout-export "$E/heldout" \
    --out "$RUN/drafter/$1.json" > "$RUN/drafter/$1.log" 2>&1
}
export -f drafter
export VENV MODEL STEPS SEQ_LEN E RUN
rm -rf "$RUN/drafter"
mkdir -p "$RUN/drafter"
{
  for s in $SEEDS; do
    echo "noprefix-seed$s $E/noprefix $s"
    echo "prefix-seed$s $E/prefix $s"
  done
} | xargs -P "${JOBS:-2}" -L 1 bash -c 'drafter "$0" "$1" "$2"'
"$PY" -m benchmarks.drafter_summary "$RUN/drafter" --yardstick noprefix-seed --by-arm \
  --out "$RUN/drafter_summary.json"
# MEASURED=docs/measured/prefix_drafter: keep the raw JSON there (the run dir is not committed).
if [ -n "${MEASURED:-}" ]; then
  rm -rf "$MEASURED"
  mkdir -p "$MEASURED/drafter"
  cp "$RUN"/drafter/*.json "$MEASURED/drafter/"
  cp "$RUN/sets.json" "$RUN/drafter_summary.json" "$MEASURED/"
  for x in prefix noprefix heldout; do
    cp "$E/$x/export_summary.json" "$MEASURED/export_summary-$x.json"
  done
fi
