# Sourced by every sbatch script here; the logic lives in megatron/apertus/launch/slurm.py.
#
#   apertus_launch --run-dir DIR [--gpu-memory-gib N] -- ENTRY_POINT [FLAGS...]
#
# In a job it runs ENTRY_POINT as one process per GPU (srun) and resubmits the job until the
# run is finished; under examples/slurm/submit.sh it only records the run for the planner.
# The batch step runs on APERTUS_HOST_PYTHON (default APERTUS_PYTHON, else python3): it needs
# only the standard library. The tasks run on APERTUS_PYTHON (submit sets it to its own Python).

apertus_launch() {
    export APERTUS_REPO="${APERTUS_REPO:-${SLURM_SUBMIT_DIR:?submit with examples/slurm/submit.sh}}"
    case ":${PYTHONPATH:-}:" in
        *":$APERTUS_REPO:"*) ;;  # a resubmitted job inherits it
        *) export PYTHONPATH="$APERTUS_REPO${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    exec "${APERTUS_HOST_PYTHON:-${APERTUS_PYTHON:-python3}}" -m megatron.apertus.launch batch "$@"
}
