"""What a client wrote, made safe to log: names of fields it sent, keys of its
``chat_template_kwargs``. Each is escaped (``\\n``, ``\\x1b``: no forged log line, no terminal
control sequence) and cut short, and only the first few are listed, so that one request can
neither write lines of its own into the gateway's log nor fill it."""

from __future__ import annotations

from collections.abc import Iterable

MAX_NAMES = 16
MAX_NAME_CHARS = 64


def loggable_names(names: Iterable[str]) -> str:
    """``names`` (client-supplied) as one log-safe line: escaped, each cut at
    :data:`MAX_NAME_CHARS`, at most :data:`MAX_NAMES` of them and a count of the rest."""
    shown: list[str] = []
    num_more = 0
    for name in names:
        if len(shown) == MAX_NAMES:
            num_more += 1
            continue
        escaped = ascii(name[:MAX_NAME_CHARS])[1:-1]  # ascii(): every non-printable as an escape
        shown.append(escaped + ("..." if len(name) > MAX_NAME_CHARS else ""))
    return ", ".join(shown) + (f" (and {num_more} more)" if num_more else "")
