"""The multi-process flags of train.py and evaluate.py, jax.distributed's start-up from them, and
host-side barriers that name the processes they wait for.

Run the same command on every host (or process): with --coordinator_address, --num_processes and
--process_id explicitly, or with --distributed to let jax detect them (TPU pod slices, SLURM,
Open MPI). Without either flag the job is one process.

Start-up: jax.distributed.initialize blocks until every process has registered and, past its
timeout, aborts with a stack trace that does not say which process is missing. So the processes
first meet on the coordinator's port in a small handshake of their own (process 0 listens, the
others say who they are); after --startup_timeout_s process 0 exits with one line naming the
processes that did not join, and they exit naming the coordinator that did not answer
(t2t/infra/handshake.py; a process of another job, --job_id, is refused). Only then is
jax.distributed started, on the same port, with the same timeout as its initialization_timeout.

Running: a process that stops answering for --heartbeat_timeout_s ends the job in one line naming
it, exit status exits.PEER_LOST (t2t/infra/peers.py), instead of jax's abort from C++.

After start-up, `wait_for`, `agree` and `share_bytes` meet over jax's coordination service (its
key-value store: host to host, no device collective), print a progress line every minute and raise
SyncError naming the processes that disagree (PeerLost, a SyncError, naming those that did not
arrive). They never start a jax backend (`python -m t2t.data` runs without one): outside a
jax.distributed job there is one process.

The decisions every process takes at the same step of a computation (stop here, this checkpoint
restored everywhere, a SIGTERM somewhere, the steps to evaluate, the next move of a save retried
through an outage) are small device collectives instead (`process_0_decides`, `process_0_ints`,
`every_process_ints`, `all_processes`, `any_process`, `sync_devices`):
every process calls them at the same point, and they return at once with one process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
from absl import flags

from t2t.infra import exits, handshake, peers
from t2t.infra.handshake import StartupError
from t2t.infra.handshake import duration as _elapsed
from t2t.infra.handshake import name_ids as _ids
from t2t.infra.handshake import prog_name as _prog

DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Call jax.distributed.initialize() with auto-detection (TPU pod '
    'slices, SLURM, Open MPI).')
COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0.')
NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the job.')
PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes-1.')
STARTUP_TIMEOUT = flags.DEFINE_float(
    'startup_timeout_s', 600.0, 'Several processes: give up (naming the processes that did not '
    'join) when not all have started within this many seconds; also jax.distributed\'s '
    'initialization timeout.', lower_bound=1.0)
HEARTBEAT_TIMEOUT = flags.DEFINE_float(
    'heartbeat_timeout_s', 100.0, 'Several processes: a process not heard from for this many '
    'seconds is lost; the job ends in one line naming it, exit status 4. jax\'s own heartbeat '
    'timeout (its abort) is set to twice this plus 10 s.', lower_bound=1.0)
JOB_ID = flags.DEFINE_string(
    'job_id', None, 'Several processes: this launch\'s identity, the same on every process; '
    'the coordinator refuses a process of another job. Default: $T2T_JOB_ID (set by '
    'scripts/launch_local.py), else SLURM\'s job id and restart count.')

PROGRESS_EVERY_S = 60.0  # a "still waiting" line this often


class SyncError(RuntimeError):
    """A host-side barrier timed out or the processes disagree: the message names them."""


class PeerLost(SyncError):
    """A barrier timed out waiting for processes, or the coordination service is gone: a peer is
    lost (train.py and evaluate.py exit with exits.PEER_LOST)."""


def initialize() -> None:
    """jax.distributed.initialize from the flags; nothing without them. Call before any jax op.

    Raises StartupError (one line) when not every process started within --startup_timeout_s.
    Then, with several processes, watches them (t2t/infra/peers.py).
    """
    if COORDINATOR.value:
        _initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value, None,
                    STARTUP_TIMEOUT.value)
    elif DISTRIBUTED.value:
        _detect_and_initialize()
    if DISTRIBUTED.value or COORDINATOR.value:
        _watch_peers()


def _detect_and_initialize() -> None:
    try:  # jax's own cluster detection, which jax.distributed.initialize() would run
        from jax._src import clusters  # private: without it, jax's start-up as it is

        detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    except (ImportError, AttributeError):
        import jax

        jax.distributed.initialize(initialization_timeout=int(STARTUP_TIMEOUT.value),
                                   heartbeat_timeout_seconds=_jax_heartbeat_s())
        return
    address, count, index, local_ids = detect(None, None, None, None, None,
                                              int(STARTUP_TIMEOUT.value))
    if address is None or count is None or index is None:
        raise StartupError('--distributed: jax detected no TPU pod, SLURM or Open MPI job; '
                           'give --coordinator_address, --num_processes and --process_id')
    _initialize(address, count, index, local_ids, STARTUP_TIMEOUT.value)


def _initialize(address, count, index, local_ids, timeout_s: float) -> None:
    if count is None or index is None:
        raise StartupError('--coordinator_address needs --num_processes and --process_id')
    if not 0 <= index < count:
        raise StartupError(f'--process_id={index} is not in 0 .. {count - 1} '
                           f'(--num_processes={count})')
    if count > 1:
        handshake.rendezvous(address, count, index, timeout_s, handshake.job_id(JOB_ID.value))
    import jax
    # Every process is up: what remains is jax's own connection. A process dying just now would
    # leave jax waiting, then aborting with a stack trace: one line from here first.
    done = threading.Event()
    threading.Thread(target=_exit_unless, daemon=True, args=(done, timeout_s, (
        f'{_prog()}: process {index}: jax.distributed.initialize did not finish within '
        f'{timeout_s:.0f} s after all {count} processes joined (coordinator {address})'))).start()
    try:
        jax.distributed.initialize(address, count, index, local_device_ids=local_ids,
                                   initialization_timeout=int(timeout_s) + 30,
                                   heartbeat_timeout_seconds=_jax_heartbeat_s())
    finally:
        done.set()


def _jax_heartbeat_s() -> int:
    return peers.jax_heartbeat_timeout(HEARTBEAT_TIMEOUT.value)


def exit_peer_lost(message: str) -> None:
    """One line, then exit with exits.PEER_LOST, skipping jax's shutdown at exit (a barrier of
    every process that would wait for the lost one)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(exits.PEER_LOST)


def _exit_unless(done: threading.Event, timeout_s: float, message: str) -> None:
    if not done.wait(timeout_s):  # the main thread is inside jax's C++ start-up: nothing else
        exit_peer_lost(message)


_watch = None  # the PeerWatch of this process's job


def _watch_peers() -> None:
    global _watch
    if process_count() > 1 and _watch is None:
        _watch = peers.PeerWatch(_client(), process_count(), process_index(),
                                 HEARTBEAT_TIMEOUT.value, _prog())


# --- host-side barriers over jax's key-value store -----------------------------------------------

_uses: dict[str, int] = {}  # every process calls the same barriers in the same order


def process_count() -> int:
    """The processes of the jax.distributed job (1 outside one); never starts a jax backend."""
    return sys.modules['jax'].process_count() if _distributed() else 1


def process_index() -> int:
    """This process's index in the jax.distributed job (0 outside one); never starts a backend."""
    return sys.modules['jax'].process_index() if _distributed() else 0


def _distributed() -> bool:
    # jax not imported: nothing can have started jax.distributed (and nothing imports it here)
    return 'jax' in sys.modules and sys.modules['jax'].distributed.is_initialized()


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _key(kind: str, name: str) -> str:
    """A fresh key directory per call, so a name can be used again (e.g. once per evaluation)."""
    use = _uses[f'{kind}/{name}'] = _uses.get(f'{kind}/{name}', -1) + 1
    return f't2t/{kind}/{name}/{use}/'


def _arrive_and_wait(client, prefix: str, value: str, waited_for: Sequence[int], name: str,
                     what: str, timeout_s: float) -> dict[int, str]:
    """Puts this process's value under prefix, then waits until every process in waited_for has
    put one; returns {process: value} of all that did. Progress line every minute."""
    import jax

    client.key_value_set(prefix + str(jax.process_index()), value)
    start = time.monotonic()
    deadline, next_progress = start + timeout_s, start + PROGRESS_EVERY_S
    while True:
        values = {int(k.rsplit('/', 1)[-1]): v for k, v in client.key_value_dir_get(prefix)}
        missing = [p for p in waited_for if p not in values]
        if not missing:
            return values
        now = time.monotonic()
        if now >= deadline:
            raise PeerLost(f'process {jax.process_index()}: gave up at {name!r} after '
                           f'{timeout_s:.0f} s waiting for {_ids(missing)}: {what}')
        if now >= next_progress:
            print(f'{_prog()}: process {jax.process_index()}: waiting for {_ids(missing)}: '
                  f'{what}, {_elapsed(now - start)} so far', flush=True)
            next_progress += PROGRESS_EVERY_S
        # Returns as soon as that key is set (then the listing is read again), else at the wait's
        # end: a wait on the service, not a poll.
        wait_ms = max(int((min(deadline, next_progress) - now) * 1000), 1)
        try:
            client.blocking_key_value_get(prefix + str(missing[0]), wait_ms)
        except Exception as e:  # jax raises its runtime error class with DEADLINE_EXCEEDED
            if 'DEADLINE_EXCEEDED' not in str(e):
                raise PeerLost(f'process {jax.process_index()}: the coordination service (process '
                               f'0) failed at {name!r}: {str(e).splitlines()[0]}') from e


def wait_for(name: str, what: str, timeout_s: float,
             processes: Sequence[int] | None = None) -> None:
    """A host-side barrier: this process arrives at `name`, then waits until every process in
    `processes` (default: all) has arrived. Every process calls it, the waited-for ones once they
    are done: e.g. the data prepared by process 0 is read after

        distributed.wait_for('data', 'process 0 prepares the data', 3600, processes=[0])

    `what` goes into the progress line printed every minute and into the SyncError raised after
    timeout_s, which names the processes that did not arrive. One process: returns at once.
    """
    count = process_count()
    waited_for = list(range(count)) if processes is None else sorted(set(processes))
    if bad := [p for p in waited_for if not 0 <= p < count]:
        raise ValueError(f'wait_for({name!r}): no {_ids(bad)} in a job of {count}')
    if count == 1:
        return
    _arrive_and_wait(_client(), _key('barrier', name), '1', waited_for, name, what, timeout_s)


def agree(name: str, value: str, timeout_s: float) -> None:
    """Every process gives its value (e.g. a digest of its data); raises SyncError naming the
    processes whose value differs from process 0's (or that did not arrive within timeout_s)."""
    count = process_count()
    if count == 1:
        return
    values = _arrive_and_wait(_client(), _key('agree', name), value, range(count), name,
                              'every process gives its value', timeout_s)
    differ = [p for p in range(count) if values[p] != values[0]]
    if differ:
        raise SyncError(f'the processes disagree on {name}: process 0 has {_short(values[0])}, '
                        + '; '.join(f'process {p} has {_short(values[p])}' for p in differ[:5])
                        + (f' ({len(differ)} differ in all)' if len(differ) > 5 else ''))


def _short(value: str, keep: int = 80) -> str:
    return repr(value if len(value) <= keep else value[:keep] + '...')


_CHUNK = 1 << 20  # bytes per key-value entry (well under the coordination service's gRPC limits)


def share_bytes(name: str, data: bytes | None, what: str, timeout_s: float) -> bytes:
    """Process 0's `data` on every process, over the key-value store (not a device collective).

    Process 0 passes the bytes and returns them at once; the others pass None and wait for them
    like `wait_for` waits (progress lines, then a SyncError naming process 0 after timeout_s).
    """
    if process_count() == 1:
        return data
    client, prefix = _client(), _key('bytes', name)
    if process_index() == 0:
        chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b'']
        for i, chunk in enumerate(chunks):
            client.key_value_set_bytes(f'{prefix}chunk/{i}', chunk)
        client.key_value_set(f'{prefix}count', str(len(chunks)))
        _arrive_and_wait(client, prefix + 'arrived/', '1', [0], name, what, timeout_s)
        return data
    _arrive_and_wait(client, prefix + 'arrived/', '1', [0], name, what, timeout_s)
    count = int(client.blocking_key_value_get(f'{prefix}count', 60_000))
    return b''.join(client.blocking_key_value_get_bytes(f'{prefix}chunk/{i}', 60_000)
                    for i in range(count))


# --- decisions taken together (device collectives; every process calls at the same point) ------


def process_0_decides(flag: bool) -> bool:
    """Process 0's flag on every process (e.g. "stop now": all leave the loop at one step)."""
    import jax

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def process_0_ints(values: list[int]) -> list[int]:
    """Process 0's list of ints on every process (e.g. the steps it sees: all decode the same)."""
    import jax

    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(values))))
    if not n:
        return []
    mine = np.asarray(values if jax.process_index() == 0 else [0] * n, np.int32)
    return [int(v) for v in multihost_utils.broadcast_one_to_all(mine)]


def every_process_ints(values: list[int]) -> list[list[int]]:
    """Every process's list of ints (the same length on each), in process order, on every
    process (e.g. each one's state of a background save and process 0's verdicts)."""
    import jax

    if jax.process_count() == 1:
        return [list(values)]
    from jax.experimental import multihost_utils

    rows = multihost_utils.process_allgather(np.asarray(values, np.int32))
    return [[int(v) for v in row] for row in np.asarray(rows).reshape(jax.process_count(), -1)]


def all_processes(flag: bool) -> bool:
    """True on every process when the flag is True on every process."""
    return not any_process(not flag)


def any_process(flag: bool) -> bool:
    """True on every process when the flag is True on some process."""
    import jax

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def sync_devices(name: str) -> None:
    """Every process waits here until all have arrived (a device barrier; no-op alone)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
