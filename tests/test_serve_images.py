"""How `qbuild serve` has an image's bytes (qbuild/backends/openai_server/serve_images.py): a data: URL decoded, an http(s) URL
fetched on the event loop within a deadline in all and a limit of fetches at once, against an HTTP server on
127.0.0.1 that answers as a hostile or broken one would (one byte every 0.2 s, a redirect, an error, too many bytes).
The server's answers to a whole request (a slow URL beside other requests) are in tests/test_vision_images.py."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qbuild.backends.openai_server.serve_images import (MAX_IMAGE_FETCHES, Fetcher, FetchesBusy, ImageSourceError,
                                              data_url_bytes, is_remote)
from qbuild.model.runtime.images import MAX_IMAGE_BYTES
from tests.conftest import wait_until

TRICKLE_BYTES = 300          # what /slow sends at most, one byte every 0.2 s: 60 s, far past any deadline here
IMAGE = b"\x89PNG\r\n\x1a\n" + b"\0" * 100


class Origin(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1: /image answers IMAGE, /slow (with any query) trickles, /moved redirects, /missing
    is a 404, /huge declares more than MAX_IMAGE_BYTES, /endless sends more than that without declaring a length.
    `trickling` counts the /slow connections open, `trickles_ended` records when each ended and `ended` its path, in
    order; `stop` ends every trickle at once."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.trickling, self.stop = 0, threading.Event()
        self.trickles_ended: list[float] = []   # time.monotonic() of each trickle's end, in order
        self.ended: list[str] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: Origin

    def do_GET(self):
        if self.path == "/moved":
            self._head(302, Location="/image")
        elif self.path == "/missing":
            self._head(404, **{"Content-Length": "0"})
        elif self.path == "/huge":
            self._head(200, **{"Content-Length": str(MAX_IMAGE_BYTES + 1)})
        elif self.path == "/endless":
            self._head(200)
            chunk = b"\0" * (1 << 20)
            for _ in range(MAX_IMAGE_BYTES // len(chunk) + 2):   # one MiB more than the limit, then it ends
                if not self._send(chunk):
                    return
        elif self.path.partition("?")[0] == "/slow":
            self._head(200)
            self._trickle()
        else:
            self._head(200, **{"Content-Length": str(len(IMAGE))})
            self.wfile.write(IMAGE)

    def _head(self, status: int, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send(self, data: bytes) -> bool:
        try:
            self.wfile.write(data)
            self.wfile.flush()
            return True
        except OSError:   # the client went away
            return False

    def _trickle(self) -> None:
        with self.server.lock:
            self.server.trickling += 1
        try:
            for _ in range(TRICKLE_BYTES):
                if not self._send(b"\0") or self.server.stop.wait(0.2):
                    return
        finally:
            with self.server.lock:
                self.server.trickling -= 1
                self.server.trickles_ended.append(time.monotonic())
                self.server.ended.append(self.path)

    def log_message(self, *args):
        pass


def fetch(url: str, **limits) -> bytes:
    async def run():
        fetcher = Fetcher(**limits)
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.close()

    return asyncio.run(run())


def test_a_url_that_trickles_is_cut_at_the_deadline_in_all():
    """One byte every 0.2 s never lets a per-read timeout expire; the deadline counts the whole fetch. (Before, the
    limit held per read and such a URL took as long as it kept sending: 60 s here.)"""
    with Origin() as origin:
        with pytest.raises(ImageSourceError, match=r"^fetching the URL took more than 1 s$"):
            fetch(f"{origin.url}/slow", timeout_s=1.0)


def test_fetches_beyond_the_limit_are_refused_at_once():
    """With `limit` fetches running, the next is refused without waiting; once one ends, a fetch goes through."""
    async def run(origin: Origin):
        fetcher = Fetcher(limit=2, timeout_s=60)
        slow = [asyncio.ensure_future(fetcher.fetch(f"{origin.url}/slow")) for _ in range(2)]
        try:
            await asyncio.to_thread(wait_until, lambda: origin.trickling == 2, 30, "two trickling fetches")
            with pytest.raises(FetchesBusy, match="the server is fetching 2 image URLs, as many as it fetches at once"):
                await fetcher.fetch(f"{origin.url}/image")
            slow[0].cancel()
            await asyncio.gather(slow[0], return_exceptions=True)
            assert await fetcher.fetch(f"{origin.url}/image") == IMAGE
        finally:
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
            await fetcher.close()

    with Origin() as origin:
        asyncio.run(run(origin))
    assert MAX_IMAGE_FETCHES >= 2


@pytest.mark.parametrize("path, message", [
    ("/moved", "the URL answered HTTP 302 (a redirect, which the server does not follow)"),
    ("/missing", "the URL answered HTTP 404 (an error)"),
    ("/huge", f"the URL's image is more than the {MAX_IMAGE_BYTES} bytes qbuild reads"),
    ("/endless", f"the URL's image is more than the {MAX_IMAGE_BYTES} bytes qbuild reads"),
])
def test_what_a_url_answers_instead_of_an_image_is_named(path, message):
    with Origin() as origin:
        with pytest.raises(ImageSourceError) as caught:
            fetch(origin.url + path)
    assert str(caught.value) == message


def test_a_fetch_ignores_the_environments_proxy(monkeypatch):
    """The fetch connects directly: a proxy named in the environment (here one that answers nothing) is not used."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    with Origin() as origin:
        assert fetch(f"{origin.url}/image") == IMAGE


def test_a_port_nobody_listens_on_is_a_reason_in_words():
    with pytest.raises(ImageSourceError, match=r"^cannot fetch the URL: \S"):
        fetch("http://127.0.0.1:9/image.png")


def test_which_urls_are_fetched_and_which_decoded():
    assert is_remote("http://127.0.0.1/x.png", True) and is_remote("HTTPS://127.0.0.1/x.png", True)
    assert not is_remote("data:image/png;base64,aGk=", False)
    with pytest.raises(ImageSourceError, match="this server does not fetch image URLs"):
        is_remote("http://127.0.0.1/x.png", False)
    with pytest.raises(ImageSourceError, match="not an image URL"):
        is_remote("file:///etc/passwd", True)
    assert data_url_bytes("data:image/png;base64,aGk=") == b"hi"
