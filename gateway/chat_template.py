"""A conversation through the model's own chat template, and which of a client's
``chat_template_kwargs`` may reach it.

The template ships with the checkpoint and is trusted; a client never supplies
one. Of ``chat_template_kwargs`` the gateway passes on:

- ``add_generation_prompt`` and ``continue_final_message`` (booleans; they override
  the request's fields of the same name, as in vLLM),
- ``tools`` and ``documents`` (lists of objects; templates with tool use or RAG read them),
- any other variable the model's template reads (``enable_thinking``,
  ``reasoning_effort``, ...), found by parsing the template once.

Keywords that steer rendering or tokenizing rather than the template
(``chat_template``, ``tokenize``, ``return_dict``, ``padding``, ...), and names the
renderer itself binds (``messages``, ``bos_token``, ``raise_exception``, ...) are
refused with a 400. Any other key is logged and ignored, as unknown request fields
are: a template that does not read it would ignore it anyway.

Rendering is plain Python (Jinja); ``gateway.tokenizer`` runs it on its work pool
(``gateway/work_pool.py``) with a time limit, so that it never holds the event loop. A
render whose waiter gives up (its time limit, or the client left) stops at the template's
next line (:func:`_stoppable`), so that a slow one never keeps its thread.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerFast

from gateway.errors import bad_request
from gateway.log_safe import loggable_names
from gateway.protocol import ChatMessage

logger = logging.getLogger(__name__)

_FLAGS = ("add_generation_prompt", "continue_final_message")
_LISTS = ("tools", "documents")
# Names transformers binds in the template's context besides its keyword arguments.
_RENDERER_NAMES = frozenset({"messages", "conversation", "raise_exception", "strftime_now", "tojson"})
# transformers' {% generation %} tag marks assistant spans; a plain parser does not know it.
_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


class ChatTemplate:
    """The model's template, the variables it reads, and the keywords a client may not set."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        templates = tokenizer.chat_template
        sources = list(templates.values()) if isinstance(templates, dict) else [templates] if templates else []
        parameters = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"self", "kwargs"}
        self.reserved = frozenset(
            (parameters - set(_FLAGS) - set(_LISTS))
            | _RENDERER_NAMES
            | set(getattr(tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", ()))
            | set(tokenizer.special_tokens_map)
        )
        self.variables = frozenset(v for source in sources for v in _undeclared_variables(source)) - self.reserved
        self.available = bool(sources)

    def render_call(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> Callable[[threading.Event], str]:
        """Check the request and return the rendering, to run off the event loop; it stops
        (raising :class:`RenderStopped`) once the event it is given is set.
        Raises APIError 400 for what the client must change."""
        if not self.available:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        kwargs: dict[str, Any] = {}
        ignored = []
        for key, value in (template_kwargs or {}).items():
            param = f"chat_template_kwargs.{key}"
            if key == "chat_template":
                raise bad_request(
                    "custom chat templates are not accepted; the model's own template is used", param=param
                )
            if key in self.reserved:
                raise bad_request(f"chat_template_kwargs may not set {key!r}: the gateway sets it", param=param)
            if key in _FLAGS:
                if not isinstance(value, bool):
                    raise bad_request(f"{key} must be true or false", param=param)
            elif key in _LISTS:
                if not (isinstance(value, list) and all(isinstance(item, dict) for item in value)):
                    raise bad_request(f"{key} must be a list of objects", param=param)
            elif key not in self.variables:
                ignored.append(key)
                continue
            kwargs[key] = value
        if ignored:
            logger.info(
                "ignoring chat_template_kwargs the model's template does not read: %s", loggable_names(sorted(ignored))
            )
        kwargs.setdefault("add_generation_prompt", add_generation_prompt)
        kwargs.setdefault("continue_final_message", continue_final_message)
        if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
            )
        conversation = [_message_dict(message, index) for index, message in enumerate(messages)]
        return partial(self._render, conversation, kwargs)

    def _render(self, conversation: list[dict[str, Any]], kwargs: dict[str, Any], stop: threading.Event) -> str:
        try:
            with _stoppable(stop):
                rendered = self.tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        except (jinja2.TemplateError, ValueError, TypeError) as error:
            # The template's own checks (raise_exception: "roles must alternate"), and data of a
            # shape it cannot use: the client's to fix.
            raise bad_request(f"cannot apply the chat template: {error}", param="messages") from error
        if not isinstance(rendered, str):  # tokenize=False renders text
            raise RuntimeError(f"bug: the chat template rendered a {type(rendered).__name__}, not text")
        return rendered


class RenderStopped(Exception):
    """A render stopped because its waiter gave up on it."""


# Jinja compiles a template from a string into Python code whose file is this name.
_TEMPLATE_FILE = "<template>"


@contextmanager
def _stoppable(stop: threading.Event) -> Iterator[None]:
    """On this thread, every line a template's compiled code runs first checks ``stop``, and
    raises :class:`RenderStopped` once it is set: a template loop holds no call a timeout
    could interrupt, and a thread cannot be killed. Other frames are not traced (about three
    times a render's plain cost, a millisecond on a 40-message conversation)."""

    def check_line(frame: FrameType, event: str, arg: object) -> Any:  # a trace function: itself
        if stop.is_set():
            raise RenderStopped
        return check_line

    def on_call(frame: FrameType, event: str, arg: object) -> Any:
        return check_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _undeclared_variables(source: str) -> set[str]:
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return jinja2.meta.find_undeclared_variables(environment.parse(_GENERATION_TAG.sub("", source)))
    except jinja2.TemplateSyntaxError as error:
        logger.warning(
            "cannot parse the model's chat template (%s); chat_template_kwargs other than %s are ignored",
            error,
            _FLAGS + _LISTS,
        )
        return set()


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates expect it: content as one string."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{index}] has a {part.type!r} content part; this server accepts text parts only",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    return result
