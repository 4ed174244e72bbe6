"""Names a client chose reach the gateway's log escaped and bounded (issue 42, item 7): an
unknown field named ``"x\\n<a forged log line>"`` or holding a terminal escape, and keys of
``chat_template_kwargs`` the template does not read, used to be logged verbatim."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from gateway.chat_template import ChatTemplate
from gateway.log_safe import MAX_NAME_CHARS, MAX_NAMES, loggable_names
from gateway.openai_common import sampling_params
from gateway.protocol import ChatMessage, CompletionRequest
from tests.gateway.inprocess import make_chat_checkpoint

FORGED = "x\n2026-01-01 00:00:00 ERROR gateway: forged\x1b[2J"


def assert_safe(line: str) -> None:
    assert line.isprintable(), repr(line)  # no newline, no escape character: one line, no control sequence
    assert "forged" in line  # still says which name it was


def test_names_are_escaped_cut_short_and_counted() -> None:
    shown = loggable_names([FORGED, "y" * 10_000, *(f"n{i}" for i in range(100))])
    assert_safe(shown)
    assert "\\n" in shown and "\\x1b" in shown
    assert f"{'y' * MAX_NAME_CHARS}..." in shown and "y" * (MAX_NAME_CHARS + 1) not in shown
    assert shown.endswith(f"(and {102 - MAX_NAMES} more)")


def test_unknown_fields_are_logged_safely(caplog: pytest.LogCaptureFixture) -> None:
    request = CompletionRequest.model_validate({"prompt": "hi", FORGED: 1})
    with caplog.at_level(logging.INFO, logger="gateway.openai_common"):
        sampling_params(request, max_tokens=4, logprobs=None)
    (line,) = [record.getMessage() for record in caplog.records if "ignoring fields" in record.getMessage()]
    assert_safe(line)


def test_unread_chat_template_kwargs_are_logged_safely(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    template = ChatTemplate(PreTrainedTokenizerFast.from_pretrained(str(make_chat_checkpoint(tmp_path))))
    with caplog.at_level(logging.INFO, logger="gateway.chat_template"):
        template.render_call([ChatMessage(role="user", content="hi")], True, False, {FORGED: 1})
    (line,) = [record.getMessage() for record in caplog.records if "chat_template_kwargs" in record.getMessage()]
    assert_safe(line)
