"""Checks every entry point runs first, before data is read or anything is compiled.

Each failure is a ConfigError (a ValueError) with a one-line message that names the config key or
the path, so train.py and evaluate.py can print it instead of a traceback.
"""

# Every length a config asks the model to handle; positions 0 .. length - 1 index the table.
LENGTH_KEYS = ('max_len', 'max_eval_len', 'max_decode_len')


class ConfigError(ValueError):
    """A config value or a path the run cannot work with."""


def check_lengths(config, keys=LENGTH_KEYS) -> None:
    """Each length fits the position table (max_position rows) of a sinusoidal/learned model.

    A longer sequence would read positions beyond the table (the model refuses them at trace time
    too; see model.Embedder). Checked for rotary positions as well, so that a config is valid or
    not whatever its position_embedding.
    """
    for key in keys:
        if config[key] > config.max_position:
            raise ConfigError(f'{key}={config[key]} exceeds max_position={config.max_position} '
                              f'(--config.{key} or --config.max_position)')


def check_training_config(config, mesh) -> None:
    """The batch splits over the mesh's data-parallel devices (and into grad_accum_steps
    micro-batches that do too); every length fits the position table.

    train.py runs it before data is read, `train.py --dry_run --topology` before it compiles.
    (Evaluation batches of any size are padded to a multiple of the devices instead.)
    """
    from t2t import sharding  # jax and flax: not for the entry points' checks that need none

    parallel = sharding.data_parallel_size(mesh)
    micro = config.batch_size // max(config.grad_accum_steps, 1)
    if config.batch_size % parallel:
        raise ConfigError(f'batch_size={config.batch_size} is not divisible by the '
                          f'{parallel} data-parallel devices of mesh {dict(mesh.shape)}')
    if config.batch_size % config.grad_accum_steps or micro % parallel:
        raise ConfigError(f'batch_size={config.batch_size} / grad_accum_steps='
                          f'{config.grad_accum_steps} must be a multiple of {parallel} devices')
    check_lengths(config)


def check_writable(workdir) -> None:
    """WORKDIR exists or can be created, and a file can be written, read and deleted in it (a
    probe object in a bucket: a missing bucket or missing rights fail here, not at the first
    checkpoint)."""
    from t2t import workdir as wd

    try:
        wd.check_writable(workdir)
    except OSError as e:
        raise ConfigError(f'workdir {wd.path(workdir)} is not writable: {e.strerror or e}') from e
