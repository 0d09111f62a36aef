#!/usr/bin/env bash
# GPU check of a multi-node SGLang engine (extract.nnodes=2) against the same engine on one
# node, through the unit workers (extract.executor=local), on the same model and records.
#
#   bash tools/gpu_check_multinode.sh            # ONE machine, 2 GPUs: tp=2 as nnodes=2 on
#                                                #   127.0.0.1 (node 0: GPU 0, node 1: GPU 1)
#   MULTINODE_MODE=srun bash tools/gpu_check_multinode.sh   # inside `salloc -N2 --gpus-per-node=8`:
#                                                #   tp=16 over the 2 nodes of the allocation
#   GPU_CHECK_REHEARSAL=1 bash tools/gpu_check_multinode.sh # on a CPU: project .venv, the test
#                                                #   stand-in rank instead of SGLang (checks the
#                                                #   script and the node plumbing, not SGLang)
#
# What it runs: (A) tp=TP on one node; (B) the same tp split over 2 nodes: node 1 started
# first in the background (it serves its ranks, claims nothing), node 0 the unit worker;
# (C, local mode only) tp=1, the bf16 reference. Then per sample and state: max abs
# difference B vs A (same math: expect 0 or bf16 reduction-order noise) and B vs C, and the
# tokens/s of A and B. Exit 1 when B lacks a sample of A or differs beyond the tolerance.
# Settings (environment): SGLANG_VENV (.venv-sglang, as tools/gpu_check.sh builds it),
# MULTINODE_DIR (runs/gpu_check_multinode), MULTINODE_MODEL (random | HF dir),
# MULTINODE_SAMPLES (64), MULTINODE_MAX_LEN (1024), MULTINODE_TP (2 local, 16 srun),
# MULTINODE_PORT (29650; node 0 also uses the next port), MULTINODE_TOL (0.05 bf16).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=${MULTINODE_MODE:-local}
REHEARSAL=${GPU_CHECK_REHEARSAL:-0}
VENV=${SGLANG_VENV:-.venv-sglang}
WORK=${MULTINODE_DIR:-runs/gpu_check_multinode}
MODEL=${MULTINODE_MODEL:-random}
SAMPLES=${MULTINODE_SAMPLES:-64}
MAX_LEN=${MULTINODE_MAX_LEN:-1024}
PORT=${MULTINODE_PORT:-29650}
TOL=${MULTINODE_TOL:-0.05}
if [ "$MODE" = srun ]; then TP=${MULTINODE_TP:-16}; else TP=${MULTINODE_TP:-2}; fi
DEVICE=cuda
EXTRA=(extract.dtype=bfloat16 extract.store_dtype=bfloat16 extract.mem_fraction_static=0.6)
if [ "$REHEARSAL" = 1 ]; then
    VENV=${SGLANG_VENV:-.venv}
    DEVICE=cpu
    EXTRA=(extract.rank_factory=test_extract_sglang:StandInRank extract.dtype=float32
           extract.store_dtype=float32)
    export PYTHONPATH="$ROOT/tests:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
PY="$ROOT/$VENV/bin/python"
mkdir -p "$WORK"
LOG="$WORK/gpu_check_multinode.txt"
exec > >(tee "$LOG") 2>&1
say() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

say "machine (mode $MODE, tp $TP)"
if [ "$REHEARSAL" = 1 ]; then echo "REHEARSAL on CPU: the stand-in rank, not SGLang"; else
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; fi
git rev-parse --short HEAD 2>/dev/null || true
[ -x "$PY" ] || { echo "no $PY: build it with tools/gpu_check.sh (or set SGLANG_VENV)"; exit 2; }
"$PY" -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

say "model ($MODEL) and records ($SAMPLES samples, up to $MAX_LEN tokens)"
if [ "$MODEL" = random ]; then
    MODEL_DIR="$WORK/model-random-llama"
    # heads divisible by tp (16 for srun mode); head_dim 64, the smallest GPU kernels take.
    "$PY" - "$MODEL_DIR" "$TP" "$REHEARSAL" <<'EOF'
import sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
out, tp, small = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
if not (out / "config.json").exists():
    torch.manual_seed(0)
    heads = max(16, tp)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=64 * heads if not small else 8 * heads,
                      intermediate_size=2816 if not small else 128, num_hidden_layers=8,
                      num_attention_heads=heads, num_key_value_heads=max(tp, 2),
                      max_position_embeddings=4096)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
print(out)
EOF
else
    MODEL_DIR="$MODEL"
fi
RECORDS="$WORK/records.jsonl"
"$PY" - "$MODEL_DIR" "$RECORDS" "$SAMPLES" "$MAX_LEN" <<'EOF'
import json, random, sys
model_dir, path, n, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = json.load(open(f"{model_dir}/config.json"))
vocab = int(cfg.get("text_config", cfg)["vocab_size"])
rng = random.Random(0)
with open(path, "w") as f:
    for i in range(n):
        total = rng.randint(32, max_len)
        p = rng.randint(8, total - 8)
        ids = [rng.randrange(vocab) for _ in range(total)]
        f.write(json.dumps({"id": f"s{i:05d}", "ok": True, "issues": [], "prompt_ids": ids[:p],
                            "output_ids": ids[p:], "loss_mask": [0] * p + [1] * (total - p)}) + "\n")
print(path)
EOF

COMMON=(extract=sglang extract.device=$DEVICE extract.executor=local extract.records="$RECORDS"
        extract.model_path="$MODEL_DIR" extract.max_len="$MAX_LEN" extract.batch_tokens=8192
        extract.units.unit_samples=16 extract.units.poll_s=1 resolve.enabled=false
        "hydra.run.dir=$WORK/hydra/\${now:%H%M%S%f}" "${EXTRA[@]}")
run_timed() {  # name, then the command; seconds into $WORK/<name>.s
    local name=$1; shift
    local t0; t0=$(date +%s.%N)
    "$@"
    python3 -c "import sys; print(round($(date +%s.%N) - $t0, 2))" > "$WORK/$name.s"
}
rm -rf "$WORK/one" "$WORK/two" "$WORK/tp1"

if [ "$MODE" = srun ]; then
    say "(A) tp=$TP on one node (8 GPUs x 2 needed: skipped in srun mode); (B) tp=$TP over 2 nodes"
    # Every task derives node_rank (SLURM_NODEID) and dist_init_addr (first host, port from
    # SLURM_JOB_ID); task 0 is the unit worker (kimi_pipe/extraction/executors/nodes.py).
    run_timed two srun --nodes=2 --ntasks-per-node=1 "$PY" -m kimi_pipe.extract "${COMMON[@]}" \
        extract.tp_size="$TP" extract.ep_size="$TP" extract.nnodes=2 \
        extract.output_dir="$WORK/two"
    say "(A) the same model, tp=8 on node 0 alone"
    run_timed one srun --nodes=1 --ntasks=1 "$PY" -m kimi_pipe.extract "${COMMON[@]}" \
        extract.tp_size=8 extract.ep_size=8 extract.output_dir="$WORK/one"
else
    say "(A) tp=$TP on one node"
    run_timed one "$PY" -m kimi_pipe.extract "${COMMON[@]}" extract.tp_size="$TP" \
        extract.output_dir="$WORK/one"
    say "(B) tp=$TP as 2 nodes on 127.0.0.1:$PORT (node 1 in the background)"
    PER=$(( TP / 2 ))
    NODES=(extract.tp_size="$TP" extract.nnodes=2 extract.dist_init_addr=127.0.0.1:$PORT
           extract.output_dir="$WORK/two")
    "$PY" -m kimi_pipe.extract "${COMMON[@]}" "${NODES[@]}" extract.node_rank=1 \
        extract.base_gpu_id="$PER" > "$WORK/node1.log" 2>&1 &
    NODE1=$!
    run_timed two "$PY" -m kimi_pipe.extract "${COMMON[@]}" "${NODES[@]}" extract.node_rank=0 \
        extract.base_gpu_id=0
    wait "$NODE1" && echo "node 1 finished cleanly" || { echo "node 1 failed:"; tail -20 "$WORK/node1.log"; exit 1; }
    tail -3 "$WORK/node1.log"
    say "(C) tp=1 (reference)"
    "$PY" -m kimi_pipe.extract "${COMMON[@]}" extract.tp_size=1 extract.output_dir="$WORK/tp1"
fi

say "states: B (2 nodes) against A (1 node) and C (tp=1)"
"$PY" - "$WORK" "$TOL" "$SAMPLES" <<'EOF'
import json, sys
from pathlib import Path
from kimi_pipe.store.unit_reader import UnitHiddenStore
work, tol, want = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
b = UnitHiddenStore(str(work / "two"))
report = {"samples_two": len(b.ids)}
bad = []
for name in ("one", "tp1"):
    if not (work / name).exists():
        continue
    a = UnitHiddenStore(str(work / name))
    report[f"samples_{name}"] = len(a.ids)
    if sorted(a.ids) != sorted(b.ids):
        bad.append(f"ids differ from {name}")
        continue
    worst: dict[str, float] = {}
    tokens = 0
    for sid in a.ids:
        x, y = a[sid], b[sid]
        tokens += int(x["input_ids"].numel())
        for key, t in x.items():
            if t.is_floating_point():
                d = float((t.float() - y[key].float()).abs().max())
                worst[key] = max(worst.get(key, 0.0), d)
            elif not bool((t == y[key]).all()):
                bad.append(f"{sid} {key} differs from {name}")
    report[f"max_abs_diff_vs_{name}"] = worst
    report["tokens"] = tokens
    if any(v > tol for v in worst.values()):
        bad.append(f"max abs difference against {name} above {tol}: {worst}")
for name in ("one", "two"):
    s = work / f"{name}.s"
    if s.exists() and report.get("tokens"):
        secs = float(s.read_text())
        report[f"{name}_s"] = secs
        report[f"{name}_tokens_per_s_end_to_end"] = round(report["tokens"] / secs, 1)
if report["samples_two"] != want:
    bad.append(f"{report['samples_two']} samples in the 2-node store, {want} records")
report["verdict"] = "FAIL: " + "; ".join(bad) if bad else "OK"
print(json.dumps(report, indent=2))
(work / "multinode_report.json").write_text(json.dumps(report, indent=2) + "\n")
sys.exit(1 if bad else 0)
EOF
