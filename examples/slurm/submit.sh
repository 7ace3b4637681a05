#!/usr/bin/env bash
# Plan a run's parallel layout and submit it only if it is valid and fits:
#
#   examples/slurm/submit.sh examples/slurm/pretrain_apertus_8b.sbatch [-- SBATCH_OPTIONS...]
#   examples/slurm/submit.sh --plan-only examples/slurm/pretrain_apertus_70b.sbatch
#
# Run it with the Python environment the tasks should use (or set APERTUS_PYTHON).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export APERTUS_REPO="$repo" PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${APERTUS_PYTHON:-python3}" -m megatron.apertus.launch submit "$@"
