"""What every entry point does before any work: parse the flags, check the config's values.

A bad `--config.key=value` is one line on stderr naming the key and what it needs, exit status 1,
before data is read or anything compiles (not absl's or ml_collections' traceback):

    train.py: --config.foo: no such config key in configs/tiny.py
    train.py: --config.num_layers: no such config key in configs/tiny.py (did you mean scan_layers?)
    train.py: --config.dropout_rate=abc: could not convert string to float: 'abc'
    train.py: dropout_rate=1.5 must be in [0, 1)
    train.py: num_eval_batches=0 must be >= 1, or -1 for all
    train.py: --config.attention_impl=splash: splash attention runs on TPU only, the target is
        cpu (use auto, xla, dot_product)
    train.py: --config.attention_impl=cudnn: dtype=float32: cuDNN flash attention takes bfloat16
        or float16 (use auto or xla)

Once the devices are known, the attention kernel a config gets is one line on stdout:

    train.py: attention_impl=auto -> cudnn (cuDNN flash attention: bfloat16, head dim 64, ...)

The value rules live in one table, t2t/run/config_checks.py.

    from t2t.run import cli
    if __name__ == '__main__':
        cli.run(main, 'train.py')      # and in main: cli.check_values(config, 'train.py') ...
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import re
import sys
from typing import NoReturn

from absl import app, flags


def _overrides(argv) -> list[tuple[str, str]]:
    """(dotted key, value) of each --config.key=value in argv, in order."""
    out = []
    for arg in argv:
        m = re.match(r'--?config\.([\w.]+)(?:=(.*))?$', arg, re.S)
        if m:
            out.append((m.group(1), m.group(2) or ''))
    return out


def _config_file(argv) -> str:
    for arg in reversed(argv):  # the last one wins, as in absl
        m = re.match(r'--?config=(.*)$', arg, re.S)
        if m:
            return m.group(1)
    return str(flags.FLAGS['config'].default_as_str or 'the default config').strip("'")


def _load_config(spec: str):
    """get_config() of a config file, as config_flags calls it ('file.py' or 'file.py:arg')."""
    path, _, arg = spec.partition(':')
    module_spec = importlib.util.spec_from_file_location('_t2t_config', path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _missing_key(argv) -> str | None:
    """One line for the first --config.key override whose key the config file lacks (with
    ml_collections' own hint rule: difflib's closest key, cutoff 0.75), or None."""
    spec = _config_file(argv)
    try:
        config = _load_config(spec)
    except Exception:  # noqa: BLE001 -- then ml_collections' own message is all there is
        return None
    for key, _ in _overrides(argv):
        node = config
        for part in key.split('.'):
            keys = list(node.keys()) if hasattr(node, 'keys') else []
            if part not in keys:
                hint = difflib.get_close_matches(part, keys, 1, 0.75)
                return (f'--config.{key}: no such config key in {spec}'
                        + (f' (did you mean {hint[0]}?)' if hint else ''))
            node = node[part]
    return None


def parse_flags(argv, prog: str):
    """absl's flag parsing with one-line errors (flags_parser of app.run)."""
    try:
        rest = flags.FLAGS(argv)
        if 'config' in flags.FLAGS:  # a config file that failed to load raises on first use
            flags.FLAGS['config'].value.keys()
        return rest
    except (KeyError, AttributeError) as e:  # ml_collections: an override of a missing key
        line = _missing_key(argv) or str(e).strip().splitlines()[0]
        print(f'{prog}: {line}', file=sys.stderr)
    except OSError as e:  # the config file itself: missing, or it raises
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        print(f'{prog}: --config={_config_file(argv)}: {lines[-1] if lines else e}',
              file=sys.stderr)
    except (flags.Error, ValueError, TypeError) as e:  # a value the flag cannot parse
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if 'parsing config file' in str(e):  # the config file raised: its last line says what
            print(f'{prog}: --config={_config_file(argv)}: {lines[-1]}', file=sys.stderr)
        else:
            print(f'{prog}: {lines[0] if lines else type(e).__name__}', file=sys.stderr)
    sys.exit(1)


def run(main, prog: str) -> None:
    """app.run(main) with parse_flags, after choosing the jax platforms (before any jax
    computation: no TPU backend, and none of libtpu's start-up errors, without TPU chips) and
    preparing a CPU-only host (platforms.prepare_cpu_host)."""
    from t2t.infra import platforms

    platforms.skip_absent_tpu()
    platforms.prepare_cpu_host()
    app.run(main, flags_parser=functools.partial(parse_flags, prog=prog))


def exit_storage_error(prog: str, error: BaseException) -> NoReturn:
    """One line for the storage failure `error` is or carries (workdir.storage_failure) and its
    exit status: STORAGE (a restart may find the storage back) for a transient one, ERROR for a
    refusal or a missing object (restarting repeats it). Any other error is raised again."""
    from t2t.infra import exits, workdir

    failure = workdir.storage_failure(error)
    if failure is None:
        raise error
    error = failure
    line = str(error) if isinstance(error, workdir.StorageError) else workdir.describe(error)
    what = '' if type(error) in (FileNotFoundError, IsADirectoryError, NotADirectoryError) else \
        'storage: '  # a path given wrong, not the storage failing
    print(f'{prog}: {what}{line}', file=sys.stderr, flush=True)
    sys.exit(exits.STORAGE if workdir.is_transient(error) or isinstance(
        error, workdir.StorageError) else exits.ERROR)


def check_values(config, prog: str) -> None:
    """The config's values a run can be built from; one line and exit 1 if not.

    The first rule of t2t/run/config_checks.py's table that the config breaks, then what the core's
    dataclasses (DecodeConfig, StepConfig with TransformerConfig) refuse: before any data or
    compile. Whether the mesh fits the devices is known once they are: startup.make_mesh.
    """
    from t2t.run import config_checks

    line = config_checks.problem(config)
    if line:
        sys.exit(f'{prog}: {line}')


def check_platform(config, platform: str, prog: str,
                   compute_capability: tuple[int, int] | None = None, echo: bool = True) -> None:
    """The attention kernel for this process's devices (platform: jax.default_backend(),
    compute_capability: its GPU's), written into config.attention_impl, with its reason printed
    when echo; one line and exit 1 for a kernel named where it cannot run
    (t2t/attention_choice.py). Not for ahead-of-time compiles, which run on the CPU."""
    from t2t import attention_choice

    configured = config.get('attention_impl', 'xla')
    try:
        impl, reason = attention_choice.resolve_attention_impl(config, platform,
                                                               compute_capability)
    except ValueError as e:
        sys.exit(f'{prog}: {e}')
    config.attention_impl = impl
    if echo:
        print(f'{prog}: {attention_choice.describe(configured, impl, reason)}', flush=True)


def check_devices(config, prog: str) -> None:
    """check_platform for the devices of this process (after jax.distributed's start), the line
    printed by process 0."""
    import jax

    from t2t import attention_choice

    platform, capability = attention_choice.this_process()
    check_platform(config, platform, prog, capability, echo=jax.process_index() == 0)
