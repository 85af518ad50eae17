"""Chat rendering for rollouts: a conversation -> prompt token ids, checked, incremental where it can be.

    ChatRenderer      one model's template, kwargs and tool-call parser; checks the template at start-up
    Conversation      one rollout's messages and prompt ids, appended turn by turn
    TemplateCheck     what the prefix-preservation check found (`check_template`)
    RenderStats       drift and cost metrics of a logging window

Tool-call parsing itself lives in `tools.parsers`; turning a rollout's turns into training samples in
`harness.rollout.reconcile`.
"""

from harness.rollout.chat.check import TemplateCheck, check_agreement, check_template, probe_conversation
from harness.rollout.chat.renderer import ChatRenderer, ChatTemplateError, Conversation, RenderStats
from harness.rollout.chat.templates import (
    TRAINING_TEMPLATES,
    TrainingTemplate,
    load_training_template,
    training_template_for,
)

__all__ = [
    "TRAINING_TEMPLATES",
    "ChatRenderer",
    "ChatTemplateError",
    "Conversation",
    "RenderStats",
    "TemplateCheck",
    "TrainingTemplate",
    "check_agreement",
    "check_template",
    "load_training_template",
    "probe_conversation",
    "training_template_for",
]
