#!/usr/bin/env bash
# Install, then train the demo GPT (dp=2 x pp=2, CPU) on a local Ray cluster.
# Extra arguments go to `elastic-trainer run`, e.g. --set train.steps=50.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
exec .venv/bin/elastic-trainer run jobs/demo.yaml "$@"
