#!/usr/bin/env bash
# The serving benchmark matrix on this machine: `serve run` of a Serve config with one coordinator replica,
# then of the same config with two; per server, gRPC and HTTP clients at concurrency 1 and 4, pipelining off
# and on. At concurrency 1 (one replica) each request also runs through the library in this process first,
# which gives the server's overhead (benchmarks/serve_bench.py --library).
#
#   bash benchmarks/serve_matrix.sh                       # deployments/config.yaml, results/serve-<date>/
#   CONFIG=deployments/config.small.yaml REQUESTS=4 TOKENS=16 bash benchmarks/serve_matrix.sh
#
# Two replicas on a 2-core machine: each replica has its own drafter and target actors, so the variant
# gives every target one torch thread and half a logical CPU (two replicas must fit Ray's 2 CPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate

CONFIG=${CONFIG:-deployments/config.yaml}
REQUESTS=${REQUESTS:-8}            # requests per protocol and level
TOKENS=${TOKENS:-64}               # new tokens per request
PROMPTS=${PROMPTS:-8}              # HumanEval prompts, in turn
OUT=${OUT:-benchmarks/results/serve-$(basename "$CONFIG" .yaml)-$(date +%Y%m%d-%H%M)}
HTTP_URL=http://127.0.0.1:8000 GRPC_TARGET=127.0.0.1:9000
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled  # a private Ray instance (deployments/README.md)
LOGS=${LOGS:-$(mktemp -d -t hetspec-serve-matrix.XXXXXX)}  # serve run logs
mkdir -p "$OUT"

variant() {  # variant REPLICAS FILE: the config with REPLICAS coordinator replicas, served on 8000/9000
  python - "$CONFIG" "$1" "$2" <<'EOF'
import sys, yaml
source, replicas, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
document = yaml.safe_load(open(source))
document["http_options"]["port"], document["grpc_options"]["port"] = 8000, 9000
args = document["applications"][0]["args"]
args["autoscaling"] = {**args.get("autoscaling", {}), "min_replicas": replicas, "max_replicas": replicas}
if replicas > 1:
    args["target"] = {**args["target"], "threads": 1}
    args["drafter"] = {**args["drafter"], "threads": 1}
    args["target_resources"] = {**args.get("target_resources", {}), "num_cpus": 0.5}
    args["drafter_resources"] = {**args.get("drafter_resources", {}), "num_cpus": 0.25}
yaml.safe_dump(document, open(out, "w"), sort_keys=False)
EOF
}

for port in 8000 9000; do  # a second `serve run` would start a second Ray whose actors take the cores
  python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', $port))" 2>/dev/null \
    || { echo "serve_matrix.sh: port $port is in use (another Serve?); stop it first" >&2; exit 1; }
done

set -m  # `serve run` in its own process group keeps SIGINT: Serve's own Ctrl-C shutdown
SERVE_PID=""
stop_serve() {
  [ -n "$SERVE_PID" ] || return 0
  kill -INT "$SERVE_PID" 2>/dev/null || true
  for _ in $(seq 120); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SERVE_PID" 2>/dev/null || true
  SERVE_PID=""
}
trap stop_serve EXIT

bench() {  # bench LABEL ARGS...: one serve_bench invocation into $OUT/LABEL
  local label=$1; shift
  python -m benchmarks.serve_bench --grpc "$GRPC_TARGET" --http "$HTTP_URL" --protocol both \
    --requests "$REQUESTS" --max-new-tokens "$TOKENS" --num-prompts "$PROMPTS" --label "$label" \
    --out "$OUT/$label" "$@"
}

for replicas in 1 2; do
  config_file="$OUT/config-${replicas}replica.yaml"
  variant "$replicas" "$config_file"
  echo "== serve run $config_file" >&2
  serve run --address local "$config_file" >"$LOGS/serve-${replicas}replica.log" 2>&1 &
  SERVE_PID=$!
  python deployments/tools/client.py wait --url "$HTTP_URL" --timeout 900 \
    || { tail -n 40 "$LOGS/serve-${replicas}replica.log" >&2; exit 1; }
  if [ "$replicas" = 1 ]; then
    bench "${replicas}replica-unpipelined" --pipelined off --concurrency 1 4 --library "$config_file"
  else
    bench "${replicas}replica-unpipelined" --pipelined off --concurrency 1 4
  fi
  bench "${replicas}replica-pipelined" --pipelined on --concurrency 1 4
  stop_serve
done
echo "results: $OUT" >&2
