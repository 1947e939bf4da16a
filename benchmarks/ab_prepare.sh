#!/usr/bin/env bash
# Copies what a build needs from a git ref into a directory of the working tree, for an A/B
# run on the GPU machine (benchmarks/ab_sizes.sh), which gets untracked files but not .git:
#   bash benchmarks/ab_prepare.sh main ab_base      (then edit ab_base/csrc/... for a variant)
# The directories are scratch: delete them before committing.
set -euo pipefail
ref=$1 dir=$2
cd "$(dirname "$0")/.."
rm -rf "$dir" && mkdir -p "$dir"
git archive "$ref" csrc fastlapsum setup.py pyproject.toml benchmarks | tar x -C "$dir"
echo "$dir <- $ref ($(git rev-parse --short "$ref"))"
