#!/usr/bin/env bash
# The former name of scripts/gpu-check.sh, which builds the GPU bundle (.gpu/, with
# .gpu/run.sh for the GPU machine) and now holds everything this script did.
exec bash "$(dirname "$0")/gpu-check.sh" "$@"
