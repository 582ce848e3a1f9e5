"""Chat templates: the GGUF's own Jinja template (tokenizer.chat_template), rendered in a sandbox
the way Hugging Face tokenizers do; llama.cpp's built-in templates when a GGUF has none or its
template fails to render."""

from __future__ import annotations

import datetime
import logging

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from orchestrator.llama import Model

log = logging.getLogger(__name__)


class ChatTemplate:
    def __init__(self, model: Model):
        self.model = model
        self.source = model.chat_template_source()
        self._template = None
        if self.source:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader()
            )
            env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
            try:
                self._template = env.from_string(self.source)
            except jinja2.TemplateError as exc:
                log.warning("the GGUF's chat template does not compile (%s): using llama.cpp's built-in", exc)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """The prompt text for `messages`. Raises ValueError if neither way can format them."""
        if self._template is not None:
            try:
                return self._template.render(
                    messages=messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.model.special_text("bos"),
                    eos_token=self.model.special_text("eos"),
                )
            except jinja2.TemplateError as exc:
                raise ValueError(f"the model's chat template failed on these messages: {exc}") from None
        return self.model.apply_chat_template(messages, add_generation_prompt)


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)
