"""The bytes of an image a chat request carries (an OpenAI `image_url` content part): a `data:` URL decoded, or, only
where the server was started with --allow-image-urls, an http(s) URL fetched within a size and a time limit.

Fetching a URL a client names makes the server a client of whatever that URL points to, on the server's network (a
server-side request forgery hazard: a metadata service, an internal admin page), so it is refused unless the operator
asks for it. Allowed, a fetch connects directly (no proxy from the environment), follows no redirect (a redirect could
lead anywhere the first URL was checked not to), reads at most MAX_IMAGE_BYTES, and gives up after
IMAGE_URL_TIMEOUT_S in all. Every decoded image then passes qbuild.model.runtime.images' limits like `qbuild run
--image`'s.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
import urllib.error
import urllib.request

from qbuild.model.runtime.images import MAX_IMAGE_BYTES

IMAGE_URL_TIMEOUT_S = 10.0      # connecting, waiting and reading one image URL, in all
_READ = 64 << 10
# data:[<media type>][;<parameter>...];base64,<data> (RFC 2397); only base64, only an image's media type.
_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(?:;[^,;]*)*),(?P<data>.*)", re.DOTALL)


class ImageSourceError(ValueError):
    """An image part whose bytes cannot be had; the message says why, without repeating the URL's data."""


def base64_size(n: int) -> int:
    """The length of `n` bytes encoded in base64."""
    return 4 * ((n + 2) // 3)


def image_bytes(url: str, allow_urls: bool) -> bytes:
    """The encoded image an `image_url.url` holds or names."""
    if url.startswith("data:"):
        return _data_url(url)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if not allow_urls:
            raise ImageSourceError("this server does not fetch image URLs (a request could make it reach any address "
                                   "it can reach); send the image as a data: URL, or start the server with "
                                   "--allow-image-urls")
        return _fetch(url)
    raise ImageSourceError("not an image URL: give a data:image/...;base64,... URL" +
                           (" or an http(s) URL" if allow_urls else ""))


def _data_url(url: str) -> bytes:
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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None   # urllib then raises HTTPError with the redirect's status


def _fetch(url: str) -> bytes:
    """At most MAX_IMAGE_BYTES of `url`, within IMAGE_URL_TIMEOUT_S; ImageSourceError otherwise."""
    deadline = time.monotonic() + IMAGE_URL_TIMEOUT_S
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers={"Accept": "image/*"}),
                         timeout=IMAGE_URL_TIMEOUT_S) as response:
            chunks, size = [], 0
            while chunk := response.read(_READ):
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise ImageSourceError(f"the URL's image is more than the {MAX_IMAGE_BYTES} bytes qbuild reads")
                if time.monotonic() > deadline:
                    raise ImageSourceError(f"fetching the URL took more than {IMAGE_URL_TIMEOUT_S:g} s")
                chunks.append(chunk)
            return b"".join(chunks)
    except ImageSourceError:
        raise
    except urllib.error.HTTPError as e:
        what = "a redirect, which the server does not follow" if 300 <= e.code < 400 else "an error"
        raise ImageSourceError(f"the URL answered HTTP {e.code} ({what})") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ImageSourceError(f"cannot fetch the URL: {reason}") from None
