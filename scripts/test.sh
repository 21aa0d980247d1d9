#!/usr/bin/env bash
# Set up (first run only) and run the test suite. GPU tests skip without CUDA; pass pytest options through.
source "$(dirname "$0")/setup.sh"
exec python -m pytest -q "$@"
