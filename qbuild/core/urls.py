"""Credentials in URLs. A URL that carries a password or token would copy it into every place the URL is recorded
(keys, the lockfile, `plan --json`, logs, a git config), so qbuild refuses such URLs instead of scrubbing each place.
"""

from __future__ import annotations

import re


def _split(url: str) -> tuple[str, str, str, str]:
    """(scheme, userinfo, "@" or "", the rest) of a `scheme://[userinfo@]host/...` URL, or of anything else read as
    scp-like `[userinfo@]host:path` (scheme "")."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0] if sep else rest
    userinfo, at, _ = authority.rpartition("@")
    return scheme.lower(), userinfo, at, rest[len(userinfo) + len(at):]


def carries_credentials(url: str) -> bool:
    """Whether `url` holds a secret: a password (`user:secret@`) in any URL, or any user name at all in an http(s)
    URL, where a token may stand alone as the user name (`https://<token>@github.com/...`). An ssh login
    (`ssh://git@host/...`, scp-like `git@host:path`) is a name, not a secret."""
    scheme, userinfo, at, _ = _split(url)
    return bool(at) and (":" in userinfo or scheme in ("http", "https"))


def without_credentials(url: str) -> str:
    """`url` without the user name and password it may carry, for a line a person reads."""
    scheme, userinfo, at, rest = _split(url)
    if not at:
        return url
    return f"{scheme}://{rest}" if scheme else rest
