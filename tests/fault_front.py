"""A fault-injecting HTTP front for the local Cloud Storage server (tests/gcs_server.py).

    front = fault_front.start(upstream_url, seed=0, p_503=0.05, p_drop=0.02)
    os.environ.update(gcs_server.environment(front.url))   # gcsfs and tensorstore go through it
    front.outage(90)                        # every request answered 503 for 90 s, from now
    front.outage(60, when=r'/checkpoints/') # ... from the first request whose path matches
    front.counts                            # {'requests': ..., 'forwarded': ..., '503': ..., ...}
    front.stop()

A threaded proxy on localhost: each request is either answered 503 without reaching the server
(a fraction p_503, and every request during an outage), forwarded and its answer then withheld
with the connection closed (a fraction p_drop: the request took effect, the client never hears
so; it retries), or forwarded and answered. Chunks of resumable uploads are never dropped: the
local server forgets a completed upload session, where Cloud Storage answers a repeat with the
object, so a drop there would test the server, not the client. Decisions come from one seeded
generator in the order requests arrive. The server's own URL in its JSON answers and headers
(resumable-upload locations, links) is rewritten to the front's, so no request goes around it.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import socket
import threading
import time
import urllib.parse

_HOP_BY_HOP = {'connection', 'keep-alive', 'proxy-connection', 'te', 'trailer', 'upgrade',
               'transfer-encoding', 'content-length'}
_UNAVAILABLE = b'{"error": {"code": 503, "message": "fault front: service unavailable"}}'


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that hung up (it retries); nothing to report


class Front:
    """A running front: .url, .outage(seconds, when=None), .end_outage(), .counts, .stop()."""

    def __init__(self, upstream_url: str, seed: int, p_503: float, p_drop: float):
        self.upstream = upstream_url.rstrip('/')
        parsed = urllib.parse.urlsplit(self.upstream)
        self._upstream_host, self._upstream_port = parsed.hostname, parsed.port or 80
        self.p_503, self.p_drop = p_503, p_drop
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._outage_until = 0.0  # time.monotonic() before which every request is a 503
        self._scheduled: tuple[re.Pattern, float] | None = None  # (path pattern, seconds)
        self.outages: list[tuple[float, float, str]] = []  # (start, end, first path) as begun
        self.counts = {'requests': 0, 'forwarded': 0, '503': 0, 'dropped': 0, 'outage_503': 0}
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'  # keep-alive, as the clients expect
            # An answer goes out as two writes (headers, then body): with Nagle's algorithm the
            # second waits for the client's delayed ACK of the first, tens of ms per request.
            disable_nagle_algorithm = True

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if 'chunked' in self.headers.get('Transfer-Encoding', '').lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b';')[0].strip() or b'0', 16)
                        if size == 0:
                            while self.rfile.readline() not in (b'\r\n', b'\n', b''):
                                pass  # trailers
                            return b''.join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get('Content-Length') or 0))

            def _handle(self):
                body = self._body()
                action = front._decide(self.path)
                if action == '503':
                    self.send_response(503)
                    self.send_header('Content-Type', 'application/json')
                    self.send_header('Content-Length', str(len(_UNAVAILABLE)))
                    self.end_headers()
                    if self.command != 'HEAD':
                        self.wfile.write(_UNAVAILABLE)
                    return
                status, reason, headers, data = front._forward(
                    self.command, self.path, self.headers, body)
                if action == 'drop':  # applied upstream; the client never hears the answer
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                self.send_response(status, reason)
                for k, v in headers:
                    self.send_header(k, v)
                if status not in (204, 304) and self.command != 'HEAD':
                    self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                if self.command != 'HEAD':
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        self._server = _Server(('127.0.0.1', 0), Handler)
        self.url = f'http://127.0.0.1:{self._server.server_address[1]}'
        self._thread = threading.Thread(target=self._server.serve_forever, name='fault_front',
                                        daemon=True)
        self._thread.start()

    # --- control, from the test ---------------------------------------------------------------

    def outage(self, seconds: float, when: str | None = None) -> None:
        """Every request answered 503 for `seconds`: from now, or (when=REGEX) from the first
        request whose path (URL-decoded) matches REGEX."""
        with self._lock:
            if when is None:
                self._begin_outage(seconds, '(now)')
            else:
                self._scheduled = (re.compile(when), seconds)

    def end_outage(self) -> None:
        with self._lock:
            self._outage_until, self._scheduled = 0.0, None

    def in_outage(self) -> bool:
        return time.monotonic() < self._outage_until

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- the proxy --------------------------------------------------------------------------

    def _begin_outage(self, seconds: float, path: str) -> None:
        start = time.monotonic()
        self._outage_until = start + seconds
        self.outages.append((start, self._outage_until, path))

    def _decide(self, path: str) -> str:
        """'503', 'drop' or 'forward' for one request (one draw of the seeded generator)."""
        with self._lock:
            self.counts['requests'] += 1
            draw = self._random.random()
            if self._scheduled is not None:
                pattern, seconds = self._scheduled
                decoded = urllib.parse.unquote(path)
                if pattern.search(decoded):
                    self._scheduled = None
                    self._begin_outage(seconds, decoded)
            if time.monotonic() < self._outage_until:
                self.counts['outage_503'] += 1
                return '503'
            if draw < self.p_503:
                self.counts['503'] += 1
                return '503'
            self.counts['forwarded'] += 1
            # Not a resumable upload's chunk: fake-gcs-server forgets a completed upload session
            # (a repeat is a 404), where Cloud Storage answers it with the object.
            if draw < self.p_503 + self.p_drop and 'upload_id=' not in path:
                self.counts['dropped'] += 1
                return 'drop'
            return 'forward'

    def _rewrite(self, data: bytes) -> bytes:
        return data.replace(self.upstream.encode(), self.url.encode())

    def _forward(self, method, path, headers, body):
        connection = http.client.HTTPConnection(self._upstream_host, self._upstream_port,
                                                timeout=120)
        try:
            out = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
            out['Content-Length'] = str(len(body))
            connection.request(method, path, body=body if body or method != 'GET' else None,
                               headers=out)
            response = connection.getresponse()
            data = response.read()
            kept = [(k, self._rewrite(v.encode('latin-1')).decode('latin-1'))
                    for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            media = 'alt=media' in path or path.startswith('/download/')
            if response.getheader('Content-Type', '').startswith('application/json') \
                    and not media:  # object bytes are never touched (their checksums)
                data = self._rewrite(data)
            return response.status, response.reason, kept, data
        finally:
            connection.close()


def start(upstream_url: str, seed: int = 0, p_503: float = 0.0, p_drop: float = 0.0) -> Front:
    """A front on a free localhost port forwarding to `upstream_url` (see the module doc)."""
    if not 0 <= p_503 + p_drop <= 1:
        raise ValueError(f'p_503 + p_drop must lie in [0, 1], got {p_503} + {p_drop}')
    return Front(upstream_url, seed, p_503, p_drop)
