"""The exit statuses of train.py and evaluate.py, in one place: launchers read them to say why a
process ended and whether a restart can help.

0 the run finished or saved and stopped (num_train_steps, time budget, SIGTERM);
1 a problem a restart cannot fix (a config value, a path, a checkpoint that does not fit: one line);
the rest are the pod's weather, ended cleanly so that a supervisor restarts from the last
checkpoint.
"""

OK = 0
ERROR = 1  # bad input: one line on stderr; restarting repeats it
HANG = 3  # the watchdog saw a step or a save run past hang_timeout_s (every stack dumped first)
PEER_LOST = 4  # another process of the job stopped answering (jax's heartbeats, or a barrier)
STORAGE = 5  # the workdir's storage failed for longer than storage_outage_limit_s

NAMES = {OK: 'finished', ERROR: 'error', HANG: 'hang', PEER_LOST: 'peer lost',
         STORAGE: 'storage outage'}
RESTARTABLE = frozenset({HANG, PEER_LOST, STORAGE})


def describe(status: int) -> str:
    """'exit 3 (hang)', 'killed by SIGKILL' (a negative status from subprocess), 'exit 7'."""
    if status < 0:
        import signal

        try:
            return f'killed by {signal.Signals(-status).name}'
        except ValueError:
            return f'killed by signal {-status}'
    return f'exit {status}' + (f' ({NAMES[status]})' if status in NAMES else '')


class ConfigError(ValueError):
    """A config value or a path the run cannot work with (exit ERROR, one line). Defined here, in
    a module that imports nothing of t2t, so that the data layer can raise it too."""
