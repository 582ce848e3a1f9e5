#!/usr/bin/env sh
# Terminal serving on Linux/macOS: set up (once) and serve; arguments go to `megacapybara serve`.
#   bats/serve.sh --port 9000 --ctx 32768
set -e
cd "$(dirname "$0")/.."
make setup
exec .venv/bin/python -m orchestrator serve "$@"
