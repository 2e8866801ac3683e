#!/usr/bin/env bash
# The benchmark comparison on an NVIDIA GPU with Hugging Face model ids (downloaded by transformers on
# first use). Installs nothing at run time beyond `pip install -e ".[dev]"` (the repo itself; set
# SKIP_INSTALL=1 to skip even that). Results: benchmarks/results/gpu-<date>/.
#
#   bash benchmarks/gpu.sh                       # defaults below
#   NUM_PROMPTS=20 TASKS="humaneval" bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=${TARGET:-Qwen/Qwen2.5-Coder-7B-Instruct}
DRAFTER=${DRAFTER:-HuggingFaceTB/SmolLM2-135M-Instruct}                  # heterogeneous: different vocabulary
SAME_VOCAB_DRAFTER=${SAME_VOCAB_DRAFTER:-Qwen/Qwen2.5-Coder-0.5B-Instruct} # baseline: the target's vocabulary
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
TASKS=${TASKS:-"humaneval summarization longctx"}
NUM_PROMPTS=${NUM_PROMPTS:-10}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
DRAFT_TOKENS=${DRAFT_TOKENS:-"3 5 8"}
PYTHON=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/gpu-$(date +%Y%m%d-%H%M)}

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  "$PYTHON" -m pip install --quiet -e ".[dev]"
fi
"$PYTHON" - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit("benchmarks/gpu.sh: torch sees no CUDA device; install the CUDA build of torch first")
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" || true
echo "bash benchmarks/gpu.sh  # TARGET=$TARGET DRAFTER=$DRAFTER SAME_VOCAB_DRAFTER=$SAME_VOCAB_DRAFTER" \
  "DTYPE=$DTYPE TASKS='$TASKS' NUM_PROMPTS=$NUM_PROMPTS MAX_NEW_TOKENS=$MAX_NEW_TOKENS" > "$OUT/command.txt"

common=(--dtype "$DTYPE" --device "$DEVICE" --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS"
        --draft-tokens $DRAFT_TOKENS --adaptive)
for task in $TASKS; do
  "$PYTHON" -m benchmarks.bench --target "$TARGET" --drafter "$DRAFTER" --label heterogeneous --task "$task" \
    "${common[@]}" --algorithms ar,slem,tli,slrs,hf-greedy,hf-assisted --out "$OUT/heterogeneous-$task"
  "$PYTHON" -m benchmarks.bench --target "$TARGET" --drafter "$SAME_VOCAB_DRAFTER" --label same-vocab --task "$task" \
    "${common[@]}" --algorithms ar,sd,slem,tli,hf-assisted --out "$OUT/same-vocab-$task"
done
"$PYTHON" -m benchmarks.plots "$OUT"/heterogeneous-* "$OUT"/same-vocab-* --out "$OUT"
echo "results in $OUT"
