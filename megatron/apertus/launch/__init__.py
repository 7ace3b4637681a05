"""Launching Apertus runs: the parallel-layout planner and the Slurm launcher.

* :mod:`.memory` and :mod:`.planner`: per-GPU parameter, memory and FLOP estimates of a layout,
  and the divisibility checks that refuse a layout before a job waits in a queue.
* :mod:`.slurm`: one process per GPU under ``srun``, environment snapshots, checkpoint hygiene,
  signals and self-resubmission (``python -m megatron.apertus.launch {submit,batch,task}``).

:mod:`.slurm` imports only the standard library: the batch step of a job may run on a host
Python without torch (e.g. when the training runs in a container).
"""
