#!/usr/bin/env bash
# The main job: from a fresh clone, install, serve the realistic pair with Ray Serve
# (deployments/config.yaml), send one real request over gRPC and one over HTTP, print the text and the
# speculation statistics, then stop Serve and Ray. Every wait is bounded; a failure says what failed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

HTTP_URL=http://127.0.0.1:8000
GRPC_TARGET=127.0.0.1:9000
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-900}   # first start converts the GGUF models (minutes on 2 cores)
REQUEST_TIMEOUT_S=${REQUEST_TIMEOUT_S:-600}
PROMPT=${PROMPT:-'def is_prime(n: int) -> bool:
    """Return True if n is a prime number."""
'}
SERVE_LOG=${SERVE_LOG:-$(mktemp -t hetspec-serve.XXXXXX.log)}

fail() { echo "main.sh: error: $*" >&2; exit 1; }

echo "== setup"
bash scripts/setup.sh || fail "scripts/setup.sh failed"
. .venv/bin/activate

# Every Ray process (replicas, actors, Serve's gRPC proxy, which ignores runtime_env) imports
# deployments/ and protos/ from here.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Ray 2.60 turns token authentication on for a cluster that `serve run` starts (and writes a token to
# ~/.ray/auth_token); this job's Ray instance is its own and bound to 127.0.0.1, so it runs without
# (deployments/README.md, "Token authentication").
export RAY_AUTH_MODE=disabled
# Serve's own timers slowed for a machine of few cores: every Ray process the server starts inherits them
# (deployments/cpu.env says why and what it costs).
set -a; . deployments/cpu.env; set +a

for port in 8000 9000; do  # config.yaml's HTTP and gRPC ports
  python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', $port))" 2>/dev/null \
    || fail "port $port is in use (another Serve?); config.yaml serves HTTP on 8000 and gRPC on 9000"
done

# Job control: `serve run` gets its own process group and, unlike a plain background job of a script,
# keeps SIGINT, so stopping it is Serve's own Ctrl-C path (serve.shutdown(), then the Ray it started stops).
set -m
SERVE_PID=""
stop_all() {
  [ -n "$SERVE_PID" ] || return 0
  echo "== stopping Serve and Ray"
  kill -INT "$SERVE_PID" 2>/dev/null || true
  for _ in $(seq 120); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  if kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "main.sh: serve run did not stop within 120 s of SIGINT; terminating it" >&2
    kill -TERM "$SERVE_PID" 2>/dev/null || true  # its Ray instance is reaped with it
    sleep 10
    kill -KILL "$SERVE_PID" 2>/dev/null || true
  fi
  echo "stopped"
}
trap stop_all EXIT

echo "== serve run deployments/config.yaml (a new local Ray instance; log: $SERVE_LOG)"
serve run --address local deployments/config.yaml >"$SERVE_LOG" 2>&1 &
SERVE_PID=$!

echo "== waiting up to ${HEALTH_TIMEOUT_S}s for $HTTP_URL/health"
deadline=$((SECONDS + HEALTH_TIMEOUT_S))
until python deployments/tools/client.py wait --url "$HTTP_URL" --timeout 10 >/dev/null 2>&1; do
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then
    tail -n 40 "$SERVE_LOG" >&2
    fail "serve run exited before the app became healthy (log above, full log: $SERVE_LOG)"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    tail -n 40 "$SERVE_LOG" >&2
    fail "the app was not healthy within ${HEALTH_TIMEOUT_S}s (full log: $SERVE_LOG)"
  fi
done
echo "healthy"

echo "== gRPC request ($GRPC_TARGET, hetspec.v1.HetSpec/Generate)"
python deployments/tools/client.py grpc --target "$GRPC_TARGET" --prompt "$PROMPT" --max-new-tokens 64 \
  --timeout "$REQUEST_TIMEOUT_S" || fail "the gRPC request failed"

echo "== HTTP request ($HTTP_URL/v1/completions, OpenAI client, streamed)"
python deployments/tools/client.py http --url "$HTTP_URL" --prompt "$PROMPT" --max-new-tokens 64 --stream \
  --timeout "$REQUEST_TIMEOUT_S" || fail "the HTTP request failed"

echo "== done"
