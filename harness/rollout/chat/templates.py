"""Training chat templates: prefix-preserving variants of model templates that re-render history.

Some official templates render an earlier turn differently once the conversation grows (Qwen3 gives only
the last assistant turn an empty think block and drops the reasoning of turns before the last user
message; Qwen3.5 drops that reasoning too). Training on such a rollout means either forking samples at
every turn or training on tokens the model never saw. A training template renders the turn being
generated exactly as the original does and every earlier turn the same way it was rendered when it was
last, so each prompt extends the one before.

The templates are package data (`harness/rollout/chat/chat_templates/*.jinja`). `training_template_for` picks
one by markers in the original template; `ChatRenderer` swaps it in only when the original fails the prefix
check, the training template passes it, and the two agree on the turn being generated
(`check.check_agreement`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class TrainingTemplate:
    """A packaged training template.

    Attributes:
        name: Its file name without `.jinja` (`qwen3`, `qwen3_5`).
        text: The Jinja source.
    """

    name: str
    text: str


TRAINING_TEMPLATES = ("qwen3", "qwen3_5")


@functools.cache
def load_training_template(name: str) -> TrainingTemplate:
    """Read a packaged training template by name; raises KeyError for an unknown name."""
    if name not in TRAINING_TEMPLATES:
        raise KeyError(f"no training template named '{name}'; there are {', '.join(TRAINING_TEMPLATES)}")
    text = (
        resources.files("harness.rollout.chat")
        .joinpath("chat_templates", f"{name}.jinja")
        .read_text(encoding="utf-8")
    )
    return TrainingTemplate(name, text)


def training_template_for(chat_template: str) -> TrainingTemplate | None:
    """The training template meant for a model's template, found by its markers; None when there is none.

    ChatML with `<tool_call>` and `</think>`: Qwen3 (JSON calls) or Qwen3.5 (`<function=` XML calls).
    """
    if "<|im_start|>" not in chat_template or "<tool_call>" not in chat_template:
        return None
    if "</think>" not in chat_template:
        return None
    return load_training_template("qwen3_5" if "<function=" in chat_template else "qwen3")
