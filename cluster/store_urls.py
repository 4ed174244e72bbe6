"""URLs of the stores instances use (the Redis registry, the LMCache store), as they may
be shown: a URL can carry a password (``redis://user:password@host:port``, Redis ACLs),
which must never reach a log line, an error message, a load report or a KV handle.

A URL without a password can take one from a file: ``SPLITSERVE_REDIS_PASSWORD_FILE``
names it (compose mounts it as a secret), so that the password is on no command line.

Torch-free: the gateway shows registry URLs too.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

REDACTED = "***"
PASSWORD_FILE_ENV = "SPLITSERVE_REDIS_PASSWORD_FILE"


def with_password_file(url: str) -> str:
    """``url`` with the password in the file ``$SPLITSERVE_REDIS_PASSWORD_FILE`` when it is a
    redis:// or rediss:// URL that carries none (a password in the URL wins); unchanged when
    the variable is unset or empty. Raises ValueError when the file cannot be read."""
    path = os.environ.get(PASSWORD_FILE_ENV, "")
    parts = urlsplit(url)
    if not path or parts.scheme not in ("redis", "rediss") or parts.password is not None:
        return url
    try:
        password = Path(path).read_text().strip()
    except OSError as error:
        raise ValueError(f"cannot read the Redis password from {PASSWORD_FILE_ENV}={path}: {error}") from None
    if not password:
        raise ValueError(f"{PASSWORD_FILE_ENV}={path} is empty: write the Redis password (requirepass) in it")
    user, _, hostport = parts.netloc.rpartition("@")
    return urlunsplit(
        (parts.scheme, f"{user}:{quote(password, safe='')}@{hostport}", parts.path, parts.query, parts.fragment)
    )


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
    shown = (
        f"{parts.scheme}://{netloc}{parts.path}"
        if "://" in url
        else urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    )
    return shown + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
