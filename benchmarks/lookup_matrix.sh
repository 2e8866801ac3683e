#!/usr/bin/env bash
# Single-request speed with every draft source, on the three tasks, against transformers' peers in the same run:
# the target alone (ar), hetspec's context lookup alone (ar+lookup-auto), SLEM with the int8 SmolLM2 drafter with
# and without context lookup, transformers' assisted generation (default and 3 draft tokens, the better two of
# default/3/5 in results/realistic-humaneval-int8-drafter) and transformers' prompt lookup decoding (10 tokens).
# One process per task; methods interleaved per prompt (benchmarks/bench.py); results in results/lookup-<task>/.
#
#   bash benchmarks/lookup_matrix.sh                  # realistic pair, 10 HumanEval (every 16th), 3 + 3 documents
#   PAIR=small HUMANEVAL=2 DOCS=1 TOKENS=16 bash benchmarks/lookup_matrix.sh   # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate

PAIR=${PAIR:-realistic}
TOKENS=${TOKENS:-128}
HUMANEVAL=${HUMANEVAL:-10}   # HumanEval problems, every 16th from HumanEval/0
DOCS=${DOCS:-3}              # summarization and long-context prompts each
THREADS=${THREADS:-2}
OUT=${OUT:-benchmarks/results}
NOTE=${NOTE:-}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

run() {  # run TASK COUNT STRIDE
  python -m benchmarks.bench --pair "$PAIR" --task "$1" --num-prompts "$2" --prompt-stride "$3" \
    --max-new-tokens "$TOKENS" --threads "$THREADS" --drafter-quantize int8 --confidence-threshold 0.5 \
    --algorithms ar,slem,hf-assisted,hf-lookup --draft-tokens 5 --hf-drafts default 3 --hf-lookup-tokens 10 \
    --lookup off auto --cost-repeats 1 --no-plots --note "$NOTE" --out "$OUT/lookup-$PAIR-$1"
}

run humaneval "$HUMANEVAL" 16
run summarization "$DOCS" 1
run longctx "$DOCS" 1
