#!/usr/bin/env bash
# Set up (first run only) and run the main job: python -m megamoe bench [options].
source "$(dirname "$0")/setup.sh"
exec python -m megamoe bench "$@"
