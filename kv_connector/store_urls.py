"""URLs of the stores instances use (the Redis registry, the LMCache store), as they may
be shown: a URL can carry a password (``redis://user:password@host:port``, Redis ACLs),
which must never reach a log line, an error message, a load report or a KV handle.

Torch-free: the gateway shows registry URLs too.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` with its password (and any ``password=`` query value) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # a malformed URL: show its scheme only, it may hold anything
        return url.split("://", 1)[0] + "://" + REDACTED if "://" in url else REDACTED
    netloc = parts.netloc
    if password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{REDACTED}@{hostport}"
    query = "&".join(
        f"{key}={REDACTED}" if key.lower() == "password" else f"{key}={value}" if sep else key
        for key, sep, value in (item.partition("=") for item in parts.query.split("&") if item)
    )
    shown = f"{parts.scheme}://{netloc}{parts.path}" if "://" in url else urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return shown + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
