"""Prompt templates: how a bare problem becomes the text a given model is prompted with.

A template belongs to the receiving model, never to the data: GRAFT re-renders peer
prompts with the receiver's own template (docs/algorithm.md step 8).

Template names:
- ``chat``: the tokenizer's own chat template, one user turn, generation prompt added
  (the zoo models ship one).
- ``paper``: the problem followed by the paper's suffix asking for step-by-step
  reasoning and a final answer in ``\\boxed{}`` (the default for real base models).
  A problem that already ends with the suffix (the shipped benchmark files do) is not
  suffixed twice.
- ``raw``: the problem as it is.
- anything containing ``{problem}``: a Python format string.
"""

from __future__ import annotations

from typing import Any

from graft_fed.errors import ConfigError

PAPER_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATE_NAMES = ("chat", "paper", "raw")


def validate_template(template: str) -> None:
    if template in TEMPLATE_NAMES:
        return
    if "{problem}" not in template:
        raise ConfigError(
            f"prompt template {template!r} is neither one of {TEMPLATE_NAMES} nor a format "
            "string containing '{problem}'")
    try:
        template.format(problem="x")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"prompt template {template!r} is not a valid format string: {exc}; "
                          "escape literal braces as '{{' and '}}'") from None


def render_prompt(problem: str, template: str, tokenizer: Any = None) -> str:
    """The text to prompt a model with for `problem` under `template`."""
    if template == "raw":
        return problem
    if template == "paper":
        body = problem.rstrip()
        return body if body.endswith(PAPER_SUFFIX) else f"{body}\n{PAPER_SUFFIX}"
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "prompt template 'chat' needs a tokenizer with a chat_template; this tokenizer has "
                "none: use template 'paper' or a format string with {problem}")
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True)
    validate_template(template)
    return template.format(problem=problem)
