"""URLs of the stores instances use (the Redis registry, the LMCache store), as they may
be shown: a URL can carry a password (``redis://user:password@host:port``, Redis ACLs),
which must never reach a log line, an error message, a load report or a KV handle.

A URL without a password can take one from a file: ``SPLITSERVE_REDIS_PASSWORD_FILE``
names it (compose mounts it as a secret), so that the password is on no command line. With
Redis ACL users of their own (the registry's, the KV store's), ``{user}`` in that path stands
for the URL's user: ``/run/secrets/redis_{user}_password`` gives ``redis://registry@redis``
and ``redis://kv@redis`` a password each, and a process holds only the files it is given.

Torch-free: the gateway shows registry URLs too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

REDACTED = "***"
PASSWORD_FILE_ENV = "SPLITSERVE_REDIS_PASSWORD_FILE"
_USER_NAME = re.compile(r"[A-Za-z0-9_-]+")  # what a user may be to name a file: no path in it


def with_password_file(url: str) -> str:
    """``url`` with the password in the file ``$SPLITSERVE_REDIS_PASSWORD_FILE`` (``{user}``
    in it: the URL's user) when it is a redis:// or rediss:// URL that carries none (a
    password in the URL wins); unchanged when the variable is unset or empty. Raises
    ValueError when the file cannot be read, or the path needs a user the URL does not name."""
    path = os.environ.get(PASSWORD_FILE_ENV, "")
    parts = urlsplit(url)
    if not path or parts.scheme not in ("redis", "rediss") or parts.password is not None:
        return url
    if "{user}" in path:
        if not parts.username or not _USER_NAME.fullmatch(parts.username):
            raise ValueError(
                f"{PASSWORD_FILE_ENV}={path} holds a password per Redis user, but {redact_url(url)} names "
                "no user (or one with other characters than letters, digits, - and _): write "
                "redis://USER@HOST:PORT"
            )
        path = path.replace("{user}", parts.username)
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
