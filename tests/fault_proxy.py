"""A fault-injecting HTTP proxy on loopback in front of the suite's S3 server, for storage-outage tests.

    proxy = start_fault_proxy(s3_server.endpoint)      # http://127.0.0.1:<port>, forwards everything
    proxy.fail("PUT", r"/out/part-", status=500, code="InternalError", for_s=6)
    ...                                                # point AWS_ENDPOINT_URL at proxy.endpoint
    proxy.stop()

A rule answers the matching requests itself, with an S3 error document (what a real store sends:
`<Error><Code>SlowDown</Code>...`), from the first matching request on (after letting `after` of
them through), for `for_s` seconds or until `clear()`; everything else goes to the server as it
came (the Host header included, so signatures still match). `faults` counts the answers it
made up, per rule. It runs in threads of the test process, so a test changes the outage while a
job runs.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_REASONS = {403: "Forbidden", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class Rule:
    method: str
    path: re.Pattern
    status: int
    code: str
    for_s: float | None  # None: until cleared
    after: int = 0  # matching requests let through before the outage starts
    seen: int = 0
    started: float | None = None
    faults: int = 0
    paths: Counter = field(default_factory=Counter)  # the faults per request path

    def applies(self, method: str, path: str) -> bool:
        """Whether this request gets the error (and counts it)."""
        if method != self.method or not self.path.search(path):
            return False
        self.seen += 1
        if self.seen <= self.after:
            return False
        now = time.monotonic()
        if self.started is None:
            self.started = now
        if self.for_s is not None and now - self.started >= self.for_s:
            return False
        self.faults += 1
        self.paths[path] += 1
        return True


@dataclass
class FaultProxy:
    endpoint: str
    upstream: str
    server: ThreadingHTTPServer
    rules: list[Rule] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, method: str, path: str, *, status: int, code: str, for_s: float | None = None,
             after: int = 0) -> Rule:
        rule = Rule(method.upper(), re.compile(path), status, code, for_s, after)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def fault_for(self, method: str, path: str) -> Rule | None:
        with self.lock:
            return next((r for r in self.rules if r.applies(method, path)), None)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _error_document(code: str, path: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>Injected by the test '
            f'proxy: {code}. Please try again.</Message><Resource>{path}</Resource><RequestId>fault'
            f'</RequestId></Error>').encode()


def start_fault_proxy(upstream: str) -> FaultProxy:
    """A proxy on a free 127.0.0.1 port forwarding to `upstream` (http://host:port)."""
    target = urlsplit(upstream)
    holder: dict[str, FaultProxy] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # quiet
            pass

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", ""):
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _handle(self) -> None:
            body = self._body()
            proxy = holder["proxy"]
            rule = proxy.fault_for(self.command, self.path)
            if rule is not None:
                document = _error_document(rule.code, self.path)
                self.send_response(rule.status, _REASONS.get(rule.status))
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(document) if self.command != "HEAD" else 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(document)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            try:
                connection.request(self.command, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                # A HEAD answer's Content-Length is the object's size: passed on as it is.
                dropped = {"transfer-encoding", "connection"}
                if self.command != "HEAD":
                    dropped.add("content-length")
                for name, value in answer.getheaders():
                    if name.lower() not in dropped:
                        self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                connection.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    proxy = FaultProxy(endpoint=f"http://127.0.0.1:{server.server_address[1]}", upstream=upstream, server=server)
    holder["proxy"] = proxy
    threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True).start()
    return proxy
