"""What ``splitserve up`` prints once the stack is ready: how to call it, never the API key
itself (terminals are scrolled back, shared and recorded), only enough of it to tell keys apart."""

from __future__ import annotations

import argparse

import pytest

from launcher.up import _print_banner, masked_key

KEY = "sk-splitserve-0123456789abcdef"


def banner(capsys: pytest.CaptureFixture[str], api_key: str | None) -> str:
    args = argparse.Namespace(api_key=api_key, model=None, host="127.0.0.1", grpc_port=50051)
    _print_banner(args, "http://127.0.0.1:8000", "SmolLM2-135M-Instruct")
    return capsys.readouterr().out


def test_the_banner_masks_the_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    shown = banner(capsys, KEY)
    assert KEY not in shown and KEY[:-4] not in shown
    assert masked_key(KEY) == "****cdef" and masked_key(KEY) in shown
    assert '-H "Authorization: Bearer $SPLITSERVE_API_KEY"' in shown
    assert "Authorization" not in banner(capsys, None)


def test_a_short_key_shows_at_most_a_quarter_of_itself() -> None:
    assert masked_key("abc") == "****"
    assert masked_key("abcdefgh") == "****gh"
