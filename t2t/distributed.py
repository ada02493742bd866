"""The multi-process flags of train.py and evaluate.py, and jax.distributed's start-up from them.

Run the same command on every host (or process): with --coordinator_address, --num_processes and
--process_id explicitly, or with --distributed to let jax detect them (TPU pod slices, SLURM,
Open MPI). Without either flag the job is one process.
"""

from absl import flags

DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Call jax.distributed.initialize() with auto-detection (TPU pod '
    'slices, SLURM, Open MPI).')
COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0.')
NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the job.')
PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes-1.')


def initialize() -> None:
    """jax.distributed.initialize from the flags; nothing without them. Call before any jax op."""
    import jax

    if COORDINATOR.value:
        jax.distributed.initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
    elif DISTRIBUTED.value:
        jax.distributed.initialize()
