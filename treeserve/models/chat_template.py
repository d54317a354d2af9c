"""Render a model's jinja2 chat template the way HF transformers does.

Same environment as transformers (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls)
and the same helpers (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII),
so a template renders to the identical string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

__all__ = ["ChatTemplateError", "render_chat_template"]


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``) or failed to parse/render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    import jinja2  # here, not at import: ~70 ms of a start that may never render a template
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    **kwargs: Any,
) -> str:
    """Render ``source`` for ``messages`` (each a mapping with at least ``role`` and ``content``).

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) and ``kwargs`` become template
    variables. Raises ``ValueError`` for a malformed message and ``ChatTemplateError`` when the
    template fails.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a mapping with a str 'role', got {m!r}")
    import jinja2

    try:
        return _compile(source).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
            **kwargs,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
