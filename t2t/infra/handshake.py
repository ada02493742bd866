"""The start-up handshake of a multi-process job, before jax.distributed starts on the same port.

Process 0 listens on the coordinator's port; every other process connects and says one line,
`t2t-join <process id> <num processes> <job id>`; once all have, process 0 answers `t2t-go` to
each (or `t2t-abort <why>` to all when the processes disagree or one is missing at the deadline)
and closes the port for jax. It listens on every interface, as jax's own service does, so what
arrives is input from the network: anything that is not such a line (a port scan, binary bytes,
a line too long, a sender that trickles) is ignored and counted, never a traceback, and no
connection can hold the others up: every connection is read as its bytes come, and start-up has
one deadline in all, timeout_s after process 0 started.

The job id (--job_id, else the launcher's T2T_JOB_ID, else SLURM's job id and restart count)
tells two launches apart: a process of another job (a restarted job's leftover, say) is refused
with one line and cannot stand in for a missing process of this one.
"""

from __future__ import annotations

import os
import re
import selectors
import socket
import sys
import time

_HELLO, _GO, _ABORT, _REFUSED = 't2t-join', 't2t-go', 't2t-abort', 't2t-refused'
MAX_LINE = 512  # bytes: a hello is far shorter; a longer line is not one
MAX_PENDING = 256  # connections that have not said hello yet; more are closed at once
_NUMBER = re.compile(r'[0-9]{1,9}')  # ASCII digits: '²'.isdigit() is True, int('²') fails
_JOB_ID = re.compile(r'[\x21-\x7e]{1,128}')  # printable ASCII without spaces
PROGRESS_EVERY_S = 60.0  # a "still waiting" line this often


class StartupError(RuntimeError):
    """The processes did not all start: the message names the ones missing."""


def job_id(flag_value: str | None) -> str:
    """This launch's identity: the flag, else the launcher's environment, else '-' (none)."""
    sources = [('--job_id', flag_value), ('T2T_JOB_ID', os.environ.get('T2T_JOB_ID'))]
    if os.environ.get('SLURM_JOB_ID'):  # a requeued SLURM job keeps its id: the restart counts
        sources.append(('SLURM_JOB_ID', f"slurm-{os.environ['SLURM_JOB_ID']}."
                                        f"{os.environ.get('SLURM_RESTART_COUNT', '0')}"))
    for name, value in sources:
        if value:
            if not _JOB_ID.fullmatch(value):
                raise StartupError(f'{name}={value!r} is not a job id (1 to 128 printable ASCII '
                                   'characters, no spaces)')
            return value
    return '-'


def parse_hello(data: bytes) -> tuple[int, int, str] | None:
    """(process id, num processes, job id) from a hello line, None for anything else."""
    line, newline, _ = data.partition(b'\n')
    if not newline or len(line) > MAX_LINE:
        return None
    try:
        words = line.decode('ascii').split(' ')
    except UnicodeDecodeError:
        return None
    if (len(words) != 4 or words[0] != _HELLO or not _NUMBER.fullmatch(words[1])
            or not _NUMBER.fullmatch(words[2]) or not _JOB_ID.fullmatch(words[3])):
        return None
    return int(words[1]), int(words[2]), words[3]


def prog_name() -> str:
    return os.path.basename(sys.argv[0]) or 'python'


def name_ids(ids) -> str:
    ids = sorted(ids)
    shown = ', '.join(map(str, ids[:20])) + (f', ... ({len(ids)} in all)' if len(ids) > 20 else '')
    return ('process ' if len(ids) == 1 else 'processes ') + shown


def duration(seconds: float) -> str:
    return f'{seconds / 60:.0f} min' if seconds >= 90 else f'{seconds:.0f} s'


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(':')
    if not sep or not _NUMBER.fullmatch(port) or not 0 < int(port) < 65536:
        raise StartupError(f'--coordinator_address={address!r} is not host:port')
    return host.strip('[]'), int(port)


def rendezvous(address: str, count: int, index: int, timeout_s: float, job: str = '-') -> None:
    """Process 0 listens on the coordinator's port until the other count-1 processes of job `job`
    said hello (then tells them to go on) or timeout_s passed (then tells those that came to give
    up and raises StartupError naming the missing ones). The others connect and wait for the
    answer; one refused as of another job raises StartupError saying so."""
    host, port = split_address(address)
    if index == 0:
        _serve(address, port, count, timeout_s, job)
    else:
        _join(address, host, port, count, index, timeout_s, job)


def _listen(port: int) -> socket.socket:
    """Every interface, like jax's own service ([::]:port)."""
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(('', port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(('', port))
    except OSError as e:
        raise StartupError(f'process 0 cannot listen on port {port} of the coordinator: '
                           f'{e.strerror or e}') from e


def _read_line(conn: socket.socket, deadline: float) -> str:
    """One short line, '' on the deadline, a closed connection or something that is not ours."""
    data = b''
    try:
        while b'\n' not in data and len(data) <= MAX_LINE:
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            chunk = conn.recv(MAX_LINE)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    line, newline, _ = data.partition(b'\n')
    return line.decode('utf-8', 'replace') if newline and len(line) <= MAX_LINE else ''


def _closed(conn: socket.socket) -> bool:
    """The other end has gone (a process that said hello, then died)."""
    try:
        conn.settimeout(0.0)  # else Python waits for data up to the socket's timeout
        return conn.recv(1, socket.MSG_PEEK) == b''
    except BlockingIOError:
        return False
    except OSError:
        return True


def _tell(conn: socket.socket, line: str) -> None:
    try:
        conn.settimeout(5.0)
        conn.sendall(f'{line}\n'.encode())
    except OSError:
        pass


class _Hellos:
    """The connections process 0 accepted that have not said a whole line yet, read as their
    bytes arrive (none can stall the others); `ignored` counts those that were not a hello."""

    def __init__(self, server: socket.socket):
        self.server, self.ignored = server, 0
        self.selector = selectors.DefaultSelector()
        server.setblocking(False)
        self.selector.register(server, selectors.EVENT_READ)
        self.pending: dict[socket.socket, bytes] = {}

    def wait(self, timeout_s: float):
        """The hellos that arrived within timeout_s: [(connection, (pid, count, job))]."""
        hellos = []
        for key, _ in self.selector.select(max(timeout_s, 0.0)):
            if key.fileobj is self.server:
                self._accept()
                continue
            conn = key.fileobj
            try:
                chunk = conn.recv(MAX_LINE + 1)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b''
            data = self.pending[conn] = self.pending[conn] + chunk
            if chunk and b'\n' not in data and len(data) <= MAX_LINE:
                continue  # more to come
            self._forget(conn)
            hello = parse_hello(data)
            if hello is None:
                self.ignored += 1
                conn.close()
            else:
                hellos.append((conn, hello))
        return hellos

    def _accept(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        if len(self.pending) >= MAX_PENDING:
            self.ignored += 1
            conn.close()
            return
        conn.setblocking(False)
        self.pending[conn] = b''
        self.selector.register(conn, selectors.EVENT_READ)

    def _forget(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        del self.pending[conn]

    def close(self) -> None:
        self.ignored += len(self.pending)  # never finished a line by the deadline
        for conn in list(self.pending):
            self._forget(conn)
            conn.close()
        self.selector.close()


def _serve(address: str, port: int, count: int, timeout_s: float, job: str) -> None:
    start = time.monotonic()
    deadline, next_progress = start + timeout_s, start + PROGRESS_EVERY_S
    joined: dict[int, socket.socket] = {}
    others, problem = [], None
    with _listen(port) as server:
        hellos = _Hellos(server)
        while problem is None:
            if len(joined) == count - 1:  # all here; but one that died meanwhile must come back
                for pid in [p for p, conn in joined.items() if _closed(conn)]:
                    joined.pop(pid).close()
                if len(joined) == count - 1:
                    break
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_progress:
                missing = set(range(1, count)) - set(joined)
                print(f'{prog_name()}: waiting for {name_ids(missing)} of {count} to join '
                      f'(coordinator {address}), {duration(now - start)} so far', flush=True)
                next_progress += PROGRESS_EVERY_S
            for conn, (pid, their_count, their_job) in hellos.wait(
                    min(deadline, next_progress) - now):
                if their_job != job:
                    print(f'{prog_name()}: refused process {pid} of another job ({their_job}; this '
                          f'job: {job})', flush=True)
                    _tell(conn, f'{_REFUSED} {job}')
                    conn.close()
                    continue
                if problem is None and their_count != count:
                    problem = (f'process {pid} has --num_processes={their_count}, process 0 has '
                               f'{count}')
                elif pid in joined and _closed(joined[pid]):  # that process restarted
                    joined.pop(pid).close()
                if problem is None and (not 0 < pid < count or pid in joined):
                    problem = f'two processes have --process_id={pid}' if pid in joined else (
                        f'a process has --process_id={pid}, outside 1 .. {count - 1}')
                if problem:
                    others.append(conn)  # told to give up with the rest
                else:
                    joined[pid] = conn
        hellos.close()
        if hellos.ignored:
            print(f'{prog_name()}: start-up ignored {hellos.ignored} connections that sent no '
                  f'{_HELLO} line', flush=True)
        missing = set(range(1, count)) - set(joined)
        if problem is None and missing:
            problem = (f'{name_ids(missing)} of {count} did not join within {timeout_s:.0f} s '
                       f'(coordinator {address})')
        for conn in [*joined.values(), *others]:
            _tell(conn, f'{_ABORT} {problem}' if problem else _GO)
            if not problem:  # let them close first, so the port is free for jax at once
                _read_line(conn, time.monotonic() + 5.0)
            conn.close()
    if problem:
        raise StartupError(problem)


def _join(address: str, host: str, port: int, count: int, index: int, timeout_s: float,
          job: str) -> None:
    start = time.monotonic()
    deadline, next_progress = start + timeout_s, start + PROGRESS_EVERY_S
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:  # process 0 is not listening yet
            now = time.monotonic()
            if now >= deadline:
                raise StartupError(f'process {index}: the coordinator {address} (process 0) did '
                                   f'not answer within {timeout_s:.0f} s') from None
            if now >= next_progress:
                print(f'{prog_name()}: process {index}: waiting for the coordinator {address} '
                      f'(process 0), {duration(now - start)} so far', flush=True)
                next_progress += PROGRESS_EVERY_S
            time.sleep(0.25)
    with conn:
        _tell(conn, f'{_HELLO} {index} {count} {job}')
        # Process 0 answers within its own timeout, which may have started a little later.
        answer = _read_line(conn, time.monotonic() + timeout_s + 30.0)
    word, _, rest = answer.partition(' ')
    if word == _ABORT:
        raise StartupError(f'process {index}: process 0 gave up: {rest}')
    if word == _REFUSED:
        raise StartupError(f'process {index}: the coordinator {address} belongs to another job '
                           f'({rest[:128]}; this process: {job})')
    if word != _GO:
        raise StartupError(f'process {index}: the coordinator {address} closed the start-up '
                           'handshake without an answer (did process 0 start without this '
                           'process, or is another job on that port?)')
