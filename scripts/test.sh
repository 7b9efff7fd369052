#!/usr/bin/env bash
# Install with test extras, then run the whole test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# promtool (Debian's prometheus package) checks the alert rules in dashboards/.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing promtool (Debian package prometheus) ..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    || echo "could not install promtool; the alert-rule checks will say so" >&2
fi
# Ray binds 127.0.0.1 with this set: tests never leave loopback.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
