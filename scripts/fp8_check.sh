#!/usr/bin/env bash
# fp8 store vs bf16 store on the demo model, end to end (README "Compact storage"):
# per-state error, teacher agreement, bytes/token of store and exports
# (scripts/fp8_measure.py), then the same EAGLE-3 drafter trained with speculators' own code on
# CPU on the bf16 store's export (two seeds: the yardstick), the fp8 store's export and the fp8
# speculators export (scripts/drafter_cpu.py, in the trainers' venv of scripts/interop.sh).
#   STEPS=300 bash scripts/fp8_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VENV=${INTEROP_VENV:-$HOME/.cache/kimi_pipe/interop-venv}
RUN=${FP8_RUN:-runs/fp8}
STEPS=${STEPS:-300}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
[ -x "$VENV/bin/python" ] || { echo "no trainers' venv at $VENV: run make interop once"; exit 2; }
"$PY" scripts/fp8_measure.py --out "$RUN"
MODEL=$("$PY" -c "from kimi_pipe.config import compose; print(compose(['model=smollm2']).model.hf_weights)")
E="$RUN/exports"
# The runs are independent: in parallel (a shared machine gives each its share of the cores).
"$VENV/bin/python" scripts/drafter_cpu.py --export "$E/bf16/speculators" --verifier "$MODEL" --seed 0 --steps "$STEPS" --out "$RUN/drafter/bf16-seed0.json" &
"$VENV/bin/python" scripts/drafter_cpu.py --export "$E/bf16/speculators" --verifier "$MODEL" --seed 1 --steps "$STEPS" --out "$RUN/drafter/bf16-seed1.json" &
"$VENV/bin/python" scripts/drafter_cpu.py --export "$E/fp8/speculators" --verifier "$MODEL" --seed 0 --steps "$STEPS" --out "$RUN/drafter/fp8store-seed0.json" &
"$VENV/bin/python" scripts/drafter_cpu.py --export "$E/fp8/speculators_fp8" --verifier "$MODEL" --seed 0 --steps "$STEPS" --out "$RUN/drafter/fp8files-seed0.json" &
wait
"$PY" - "$RUN/drafter" <<'PYEOF'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text())
    v = r["val"]
    acc = {k: round(x, 4) for k, x in v.items() if "acc" in k}
    print(f"{p.stem:18} backend={r['backend']:5} train_loss_last50={r['train_loss_last50']:.4f} "
          f"val_loss={v.get('loss_total', float('nan')):.4f} {acc}")
PYEOF
