"""The start-up handshake (t2t/infra/handshake.py) takes input from the network: garbage is ignored
and counted, a trickling sender holds nothing up, the deadline is one for all, and a process of
another job is refused. Process 0 and the others run in threads of this process (no jax)."""

import random
import socket
import threading
import time

import pytest

from t2t.infra import handshake
from tests.test_multiprocess import _free_port


class _Run(threading.Thread):
    """rendezvous() in a thread: .error is its StartupError (None when it went on), .took the
    seconds it ran."""

    def __init__(self, port, count, index, timeout_s, job='job-a'):
        super().__init__(daemon=True)
        self.args = (f'localhost:{port}', count, index, timeout_s, job)
        self.error, self.took = None, None
        self.start()

    def run(self):
        start = time.monotonic()
        try:
            handshake.rendezvous(*self.args)
        except handshake.StartupError as e:
            self.error = str(e)
        self.took = time.monotonic() - start


def _connect(port):
    for _ in range(100):
        try:
            return socket.create_connection(('localhost', port), timeout=5)
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f'nothing listens on port {port}')


def _trickle(conn, data: bytes, stop: threading.Event, every_s=0.2):
    """Sends one byte at a time until stopped (or the data runs out): never a whole line."""
    def send():
        for byte in data:
            if stop.wait(every_s):
                break
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                break
    threading.Thread(target=send, daemon=True).start()


def test_hello_lines_are_parsed_strictly():
    assert handshake.parse_hello(b't2t-join 1 2 job-a\n') == (1, 2, 'job-a')
    assert handshake.parse_hello(b't2t-join 1 2 job-a\nmore') == (1, 2, 'job-a')
    for bad in (b't2t-join \xc2\xb2 2 job-a\n',  # '\u00b2'.isdigit() is True; int() fails
                't2t-join ² 2 -\n'.encode(), b't2t-join 1 2\n', b't2t-join 1 2 job-a',
                b't2t-join -1 2 job-a\n', b't2t-join 1 2 job a\n', b'\xff\xfe\n',
                b't2t-join 1 2 ' + b'x' * 600 + b'\n', b'GET / HTTP/1.1\r\n', b'\n'):
        assert handshake.parse_hello(bad) is None, bad


def test_job_id_comes_from_the_flag_or_the_launcher(monkeypatch):
    for name in ('T2T_JOB_ID', 'SLURM_JOB_ID', 'SLURM_RESTART_COUNT'):
        monkeypatch.delenv(name, raising=False)
    assert handshake.job_id(None) == '-'
    monkeypatch.setenv('SLURM_JOB_ID', '4711')
    assert handshake.job_id(None) == 'slurm-4711.0'
    monkeypatch.setenv('SLURM_RESTART_COUNT', '2')
    assert handshake.job_id(None) == 'slurm-4711.2'
    monkeypatch.setenv('T2T_JOB_ID', 'launch-7')
    assert handshake.job_id(None) == 'launch-7'
    assert handshake.job_id('mine') == 'mine'
    with pytest.raises(handshake.StartupError, match=r"^--job_id='a b' is not a job id \(1 to "):
        handshake.job_id('a b')
    monkeypatch.setenv('T2T_JOB_ID', 'x' * 129)
    with pytest.raises(handshake.StartupError, match=r'^T2T_JOB_ID=.* is not a job id'):
        handshake.job_id(None)


def test_garbage_is_ignored_and_counted_and_start_up_goes_on(capsys):
    """Before process 1 says hello: a '²' hello, binary bytes, an over-long line, a closed
    connection and a sender that trickles a hello forever, none of which stops process 0; each
    is counted. The trickler is still trickling when the processes go on, long before the
    deadline."""
    port = _free_port()
    server = _Run(port, 2, 0, timeout_s=30)
    stop, garbage = threading.Event(), []
    for data in ('t2t-join ² 2 job-a\n'.encode(), random.Random(0).randbytes(3000),
                 b't2t-join 1 2 ' + b'7' * 1000 + b'\n', b''):
        conn = _connect(port)
        conn.sendall(data)
        garbage.append(conn)
        if not data:
            conn.close()
    trickler = _connect(port)
    _trickle(trickler, b't2t-join 1 2 job-a ' * 100, stop)  # no end of line
    time.sleep(0.5)
    joiner = _Run(port, 2, 1, timeout_s=30)
    joiner.join(10)
    server.join(10)
    stop.set()
    assert (server.error, joiner.error) == (None, None)
    assert server.took < 5, server.took  # not the 30 s deadline
    out = capsys.readouterr().out
    # the four garbage connections and the trickler, closed at the end
    assert ': start-up ignored 5 connections that sent no t2t-join line\n' in out, out
    for conn in [*garbage, trickler]:
        conn.close()


def test_a_trickling_sender_cannot_stretch_the_deadline():
    """Process 2 never comes; a sender trickles bytes the whole time: process 0 and process 1
    give up at the 2 s deadline, naming process 2."""
    port = _free_port()
    server = _Run(port, 3, 0, timeout_s=2)
    stop = threading.Event()
    trickler = _connect(port)
    _trickle(trickler, b't2t-join 2 3 job-a' * 100, stop, every_s=0.1)
    joiner = _Run(port, 3, 1, timeout_s=2)
    server.join(10)
    joiner.join(10)
    stop.set()
    trickler.close()
    assert server.error == 'process 2 of 3 did not join within 2 s (coordinator localhost:' \
        f'{port})'
    assert joiner.error.startswith('process 1: process 0 gave up: process 2 of 3 did not join')
    assert 2.0 <= server.took < 2.6, server.took


def test_a_process_of_another_job_is_refused(capsys):
    """Process 1 of job B is refused at once, in one line on both sides; process 1 of job A then
    joins as usual."""
    port = _free_port()
    server = _Run(port, 2, 0, timeout_s=20, job='job-a')
    stale = _Run(port, 2, 1, timeout_s=20, job='job-b')
    stale.join(10)
    assert stale.error == (f'process 1: the coordinator localhost:{port} belongs to another job '
                           '(job-a; this process: job-b)')
    assert stale.took < 5 and server.is_alive()
    joiner = _Run(port, 2, 1, timeout_s=20, job='job-a')
    joiner.join(10)
    server.join(10)
    assert (server.error, joiner.error) == (None, None)
    out = capsys.readouterr().out
    assert out.count('refused') == 1 and out.rstrip().endswith(
        ': refused process 1 of another job (job-b; this job: job-a)'), out
