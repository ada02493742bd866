"""Checks every entry point runs first, before data is read or anything is compiled.

Each failure is a ConfigError (a ValueError) with a one-line message that names the config key or
the path, so train.py and evaluate.py can print it instead of a traceback.
"""


from t2t.infra import exits

ConfigError = exits.ConfigError  # here too: every entry point catches startup.ConfigError


def check_lengths(config) -> None:
    """Each length the config asks for (config_checks.LENGTH_KEYS) fits the position table
    (max_position rows): the rule of t2t/run/config_checks.py, for callers that skip the CLI's."""
    from t2t.run import config_checks

    line = config_checks.problem(config, config_checks.LENGTH_KEYS)
    if line:
        raise ConfigError(line)


def make_mesh(config, devices=None):
    """sharding.make_mesh of config.mesh_shape and dcn_mesh_shape over `devices` (default: all);
    a mesh the devices cannot form (3 devices asked of 1, slices of unequal size) is a
    ConfigError, one line, before data or compile."""
    from t2t import sharding

    try:
        return sharding.make_mesh(config.mesh_shape, devices, config.dcn_mesh_shape)
    except ValueError as e:
        raise ConfigError(str(e)) from e


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
    from t2t.infra import workdir as wd

    try:
        wd.check_writable(workdir)
    except OSError as e:
        raise ConfigError(f'workdir {wd.path(workdir)} is not writable: {e.strerror or e}') from e
