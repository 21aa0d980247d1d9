#!/usr/bin/env bash
# Set up (first run only) and run the main job: python -m megamoe bench [options].
caller="$PWD"
source "$(dirname "$0")/setup.sh"
# setup.sh works in the repository root; the bench runs where it was called, so that relative paths
# (--json, --plot, --from-json) mean what they mean to the caller. The editable install imports from anywhere.
cd "$caller"
exec python -m megamoe bench "$@"
