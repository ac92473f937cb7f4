"""A model's Jinja chat template, rendered as Hugging Face's ``apply_chat_template`` and llama-server
``--jinja`` render it: ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``/``eos_token``,
any ``chat_template_kwargs`` (``enable_thinking``), and the extras templates call - ``raise_exception``,
``strftime_now``, and a ``tojson`` that writes JSON as Python's ``json.dumps`` does (Jinja's own escapes
``<``, ``>``, ``&`` and ``'`` for HTML, which would change the prompt).

Templates run in Jinja's immutable sandbox: a template is data from a model file, not trusted code.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property

from weaved.errors import InvalidRequest

RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class TemplateError(InvalidRequest):
    """The template refused the conversation (its ``raise_exception``) or failed to render (a 400: the
    conversation is the client's)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None) -> str:
    from markupsafe import Markup

    return Markup(json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                             separators=separators))


class ChatTemplate:
    """One chat template's source, compiled once."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @cached_property
    def _env(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env

    @cached_property
    def _compiled(self):
        from jinja2.exceptions import TemplateSyntaxError

        try:
            return self._env.from_string(self.source)
        except TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e}") from None

    @cached_property
    def variables(self) -> frozenset[str]:
        """The variables the template reads from its caller (those it never sets itself): what a request's
        ``chat_template_kwargs`` may give it."""
        from jinja2 import meta

        self.check()
        return frozenset(meta.find_undeclared_variables(self._env.parse(self.source))) - self._env.globals.keys()

    def check(self) -> None:
        """ValueError when the source does not compile (a file given at start is refused there)."""
        self._compiled  # noqa: B018  (compiled once, kept)

    @property
    def mentions_tools(self) -> bool:
        """Whether the template has a branch for tool definitions (else Weave's generic format is used)."""
        return "tools" in self.source

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               kwargs: dict | None = None) -> str:
        """The prompt text.  ``kwargs`` (a request's ``chat_template_kwargs``) become template variables;
        they may not replace the variables Weave sets.  TemplateError when the template refuses."""
        extra = dict(kwargs or {})
        clash = RESERVED & extra.keys()
        if clash:
            raise TemplateError(f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs")
        unread = sorted(extra.keys() - self.variables)  # a variable the template never reads would be ignored
        if unread:
            offered = sorted(self.variables - RESERVED)
            raise TemplateError(f"chat_template_kwargs: this model's chat template does not read {unread} (it reads "
                                f"{offered or 'no variables beyond the conversation'})", param="chat_template_kwargs")
        from jinja2.exceptions import TemplateError as JinjaError

        try:
            return self._compiled.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError:
            raise
        except JinjaError as e:
            raise TemplateError(f"the chat template failed: {e}") from None
        except Exception as e:  # (a template is data: whatever it raises - 1/0, a recursion - is its failure)
            raise TemplateError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from None
