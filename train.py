"""Train a Transformer.

    python train.py --config=configs/default.py --workdir=workdirs/default
    python train.py --config=configs/wmt14_ende_base.py --config.batch_size=208 --workdir=runs/base
    python train.py --config=configs/wmt14_ende_big.py --dry_run     # parameters and FLOPs only
    python train.py --config=configs/wmt14_ende_big.py --dry_run --topology=v5e-16 \
        [--config.mesh_shape=1,16,1] [--config.batch_size=256] [--find_max_batch]
    python train.py --config=configs/wmt14_ende_base.py --dry_run --topology=8xh100

--topology compiles the train step and the beam search for that TPU slice (pip install -e
'.[tpu]') or those GPU nodes (8xh100, 1xh200, a100-80g, 2x8xb200; pip install -e '.[gpu-aot]') on
this machine's CPU and reports per-device memory against the device's HBM, XLA's FLOPs and an
estimate of the step time; exit status 0 when it fits, 1 when it does not (or only by XLA's own
rematerialization), 2 on a bad target name, mesh or batch.

A workdir that holds checkpoints is resumed from the newest good one. Multi-host: run the same
command on every host; jax.distributed is initialized from --coordinator_address/--num_processes/
--process_id, or detected automatically on TPU pods and SLURM/Open MPI clusters (--distributed).
SIGTERM saves a checkpoint and exits 0; `kill -USR1 <pid>` prints every thread's stack to stderr
(a job that seems stuck); a step or a checkpoint save that runs far longer than usual prints them
by itself (config straggler_factor, slow_save_s). WORKDIR/run-<UTC start>.json records what ran.
WORKDIR/goodput/ records where the time went (`python -m t2t.goodput WORKDIR`); compiles are
cached across restarts (config compilation_cache_dir); config profile_start_step takes a profile.
Processes that do not all start within --startup_timeout_s are named in one line, exit 1; a
process lost later (--heartbeat_timeout_s, a barrier) is named in one line, exit 4; a step or save
stuck for hang_timeout_s exits 3 (t2t/infra/exits.py). A config, workdir or checkpoint problem is
one line on stderr, exit 1.
"""

import faulthandler
import signal
import sys
import time

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from t2t import goodput
from t2t.infra import distributed
from t2t.run import cli, compile_cache

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and logs go here.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Build the abstract model, print its summary, exit.')


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    config = _CONFIG.value
    cli.check_values(config, 'train.py')
    if (_TOPOLOGY.value and not _DRY_RUN.value) or (_FIND_MAX_BATCH.value and not _TOPOLOGY.value):
        raise app.UsageError('--topology needs --dry_run, --find_max_batch needs --topology')
    if _DRY_RUN.value:
        from t2t.run import summary

        if _TOPOLOGY.value:
            sys.exit(_aot_dry_run(config, summary))
        print(summary.summarize(config))
        return
    if not _WORKDIR.value:
        raise app.UsageError('--workdir is required (checkpoints, metrics and logs go there)')
    # The attempt's start record first (t2t/goodput/ledger.py): a kill during start-up counts.
    index = (distributed.PROCESS_ID.value if distributed.COORDINATOR.value else
             None if distributed.DISTRIBUTED.value else 0)  # --distributed: known after init
    goodput.open_attempt(_WORKDIR.value, index, distributed.NUM_PROCESSES.value or 1,
                         config.goodput_all_processes)
    started = time.perf_counter()
    try:
        distributed.initialize()
    except distributed.StartupError as e:  # one line naming the processes that did not join
        sys.exit(f'train.py: {e}')
    goodput.note_startup('distributed_init', started)
    import jax

    cli.check_devices(config, 'train.py')
    compile_cache.setup(config)
    if not flags.FLAGS['verbosity'].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO

    from t2t.infra import workdir
    from t2t.run import checkpoint, startup
    from t2t.train import loop

    workdir.quiet_transient_failures()

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        result = loop.train_and_evaluate(config, _WORKDIR.value)
    except distributed.PeerLost as e:  # exit 4: a restart of the job can help
        distributed.exit_peer_lost(f'train.py: {e}')
    except (startup.ConfigError, checkpoint.CheckpointError, loop.NonFiniteLossError,
            distributed.SyncError) as e:
        sys.exit(f'train.py: {e}')
    except Exception as e:  # the storage's own errors (gcsfs, google-auth, tensorstore, OSError)
        cli.exit_storage_error('train.py', e)  # raises e again when it is not one
    print(f'finished at step {result.step} ({result.stopped_by}); '
          + ' '.join(f'{k}={v:.4g}' for k, v in result.eval_metrics.items()))
    if jax.process_index() == 0:
        from t2t.goodput import report as goodput_report

        goodput_report.print_summary(_WORKDIR.value)  # where the time went


# --dry_run --topology: ahead-of-time compile (t2t/aot/targets.py, tpu.py; report in report.py)
_TOPOLOGY = flags.DEFINE_string(
    'topology', None, 'With --dry_run: compile for this TPU slice or these GPU nodes on the CPU '
    'and report memory, FLOPs and time (v4-8, v5e-16, v5p-8, v6e-256, a topology such as '
    'v5e:4x4; 1xh100, 8xh100, 8xh200, 8xa100-80g, 8xb200, 2x8xh100: nodes x GPUs x card).')
_FIND_MAX_BATCH = flags.DEFINE_bool(
    'find_max_batch', False, 'With --topology: search the largest batch_size that fits.')
_MAX_BATCH_TRIES = flags.DEFINE_integer(
    'max_batch_tries', 8, 'With --find_max_batch: at most this many compiles.', lower_bound=1)
_BATCH_STEP = flags.DEFINE_integer(
    'batch_step', 0, 'With --find_max_batch: try multiples of this (0: the data-parallel devices '
    'x grad_accum_steps).', lower_bound=0)


def _aot_dry_run(config, summary) -> int:
    """The exit status: 0 fits, 1 does not, 2 bad input (reported before anything compiles)."""
    from t2t.aot import report as aot_report
    from t2t.aot import tpu as aot

    try:
        plan = aot.plan(config, _TOPOLOGY.value, _BATCH_STEP.value)
    except (ValueError, ImportError) as e:  # ImportError: the target's compiler not installed
        print(f'train.py: {e}', file=sys.stderr)
        return 2
    print(summary.summarize(config), flush=True)
    return aot_report.dry_run(config, plan, find_max_batch=_FIND_MAX_BATCH.value,
                              max_tries=_MAX_BATCH_TRIES.value)


if __name__ == '__main__':
    cli.run(main, 'train.py')
