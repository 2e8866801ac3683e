#!/usr/bin/env bash
# Create .venv and install hetspec with its serving and test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's prometheus (prometheus and promtool): the tests of cluster/prometheus/ and of a live Prometheus scraping
# the app (tests/test_prometheus_rules.py, tests/test_prometheus_serve.py). Skipped when already installed.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --disable-pip-version-check --upgrade pip
# torch first and pinned: on this CPU machine pip takes the local CPU wheel; an unpinned torch pulls a CUDA build.
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[serve,dev]"
python -m pip check
# iproute2 for the test hosts in network namespaces (cluster/netns/hosts.py, tests/test_netns.py), as root.
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
fi
