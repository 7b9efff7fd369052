#!/usr/bin/env bash
# Install with test extras, then run the whole test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Ray binds 127.0.0.1 with this set: tests never leave loopback.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
