"""The bytes of an image a chat request carries (an OpenAI `image_url` content part): a `data:` URL decoded, or, only
where the server was started with --allow-image-urls, an http(s) URL fetched within a size and a time limit.

Fetching a URL a client names makes the server a client of whatever that URL points to, on the server's network (a
server-side request forgery hazard: a metadata service, an internal admin page), so it is refused unless the operator
asks for it. Allowed, a fetch connects directly (no proxy from the environment), follows no redirect (a redirect could
lead anywhere the first URL was checked not to), reads at most MAX_IMAGE_BYTES, and gives up after
IMAGE_URL_TIMEOUT_S in all: connecting, waiting and reading together, however slowly the bytes come. It runs on the
server's event loop with an async client (httpx2), so a slow URL holds up no other request: not the thread that
prepares requests, not the one that generates. At most MAX_IMAGE_FETCHES run at once; a request beyond them is refused
at once (a 503), rather than wait behind URLs that may each take the whole deadline. Every image then passes
qbuild.model.runtime.images' limits like `qbuild run --image`'s.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re

from qbuild.model.runtime.images import MAX_IMAGE_BYTES

IMAGE_URL_TIMEOUT_S = 10.0      # connecting, waiting and reading one image URL, in all
# Image URLs fetched at once. A fetch costs a connection and up to MAX_IMAGE_BYTES of memory while it runs, and one
# generation runs at a time: a few fetches ahead of it keep it busy.
MAX_IMAGE_FETCHES = 4
# data:[<media type>][;<parameter>...];base64,<data> (RFC 2397); only base64, only an image's media type.
_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(?:;[^,;]*)*),(?P<data>.*)", re.DOTALL)


class ImageSourceError(ValueError):
    """An image part whose bytes cannot be had; the message says why, without repeating the URL's data."""


class FetchesBusy(ImageSourceError):
    """As many image URLs are being fetched as the server fetches at once."""


def base64_size(n: int) -> int:
    """The length of `n` bytes encoded in base64."""
    return 4 * ((n + 2) // 3)


def is_remote(url: str, allow_urls: bool) -> bool:
    """Whether an `image_url.url` names an image to fetch (http, https) rather than holds one (data:);
    ImageSourceError where it is neither, or a URL the server does not fetch."""
    if url.startswith("data:"):
        return False
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if not allow_urls:
            raise ImageSourceError("this server does not fetch image URLs (a request could make it reach any address "
                                   "it can reach); send the image as a data: URL, or start the server with "
                                   "--allow-image-urls")
        return True
    raise ImageSourceError("not an image URL: give a data:image/...;base64,... URL" +
                           (" or an http(s) URL" if allow_urls else ""))


def data_url_bytes(url: str) -> bytes:
    """The encoded image a data: URL holds."""
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise ImageSourceError("a data: URL must read data:<media type>;base64,<data>")
    params = [p.strip().lower() for p in match["params"].split(";") if p.strip()]
    if "base64" not in params:
        raise ImageSourceError("a data: URL must hold its image base64-encoded (data:image/png;base64,...)")
    media = match["type"].strip().lower()
    if not media.startswith("image/"):
        raise ImageSourceError(f"the data: URL holds {media or 'text/plain'!r}, not an image/ media type")
    data = match["data"]
    if len(data) > base64_size(MAX_IMAGE_BYTES):
        raise ImageSourceError(f"the image is more than the {MAX_IMAGE_BYTES} bytes qbuild reads")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageSourceError("the data: URL's data is not valid base64") from None


class Fetcher:
    """The image URLs of one server, fetched on its event loop: at most `limit` at once, each within `timeout_s` in
    all. The client is made once, outside the loop (making one loads the system's certificates, which would block
    the loop), and closed when the server stops."""

    def __init__(self, limit: int = MAX_IMAGE_FETCHES, timeout_s: float = IMAGE_URL_TIMEOUT_S):
        import httpx2

        self.limit, self.timeout_s, self.running = limit, timeout_s, 0
        # trust_env=False: no proxy or netrc from the environment; redirects are answered, never followed
        self._client = httpx2.AsyncClient(trust_env=False, follow_redirects=False, timeout=timeout_s,
                                          headers={"Accept": "image/*", "Accept-Encoding": "identity"})

    async def fetch(self, url: str) -> bytes:
        """At most MAX_IMAGE_BYTES of `url`, within the deadline; ImageSourceError otherwise, FetchesBusy at once
        where `limit` fetches are running."""
        if self.running >= self.limit:
            raise FetchesBusy(f"the server is fetching {self.running} image URLs, as many as it fetches at once; send "
                              "the request again shortly, or the image as a data: URL")
        self.running += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._get(url)
        except TimeoutError:
            raise ImageSourceError(f"fetching the URL took more than {self.timeout_s:g} s") from None
        finally:
            self.running -= 1

    async def _get(self, url: str) -> bytes:
        import httpx2

        too_large = ImageSourceError(f"the URL's image is more than the {MAX_IMAGE_BYTES} bytes qbuild reads")
        try:
            async with self._client.stream("GET", url) as response:
                if response.status_code != 200:
                    code = response.status_code
                    what = "a redirect, which the server does not follow" if 300 <= code < 400 else "an error"
                    raise ImageSourceError(f"the URL answered HTTP {code} ({what})")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                    raise too_large
                chunks, size = [], 0
                async for chunk in response.aiter_raw():   # as sent: a compressed body is no image
                    size += len(chunk)
                    if size > MAX_IMAGE_BYTES:
                        raise too_large
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx2.HTTPError as e:
            raise ImageSourceError(f"cannot fetch the URL: {_reason(e)}") from None

    async def close(self) -> None:
        await self._client.aclose()


def _reason(error: Exception) -> str:
    """What went wrong with a fetch, in words: the client's message, or its kind where it has none."""
    return str(error) or type(error).__name__
