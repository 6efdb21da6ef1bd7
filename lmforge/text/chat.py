"""lmforge's chat format, shared by the stages that make tokenizers: ChatML with generation markers.

Curation's own tokenizer carries it; a base model without a chat template gets it
(`training.base.prepare`). The assistant's content and its <|im_end|> sit in {% generation %}
markers, which transformers' apply_chat_template turns into an assistant-token mask: TRL trains on
exactly those tokens (and so learns to stop at <|im_end|>). Rendered text is plain ChatML either way.
"""

from __future__ import annotations

import re

PAD = "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# the same template for renderers without transformers' `generation` extension (plain jinja2)
PLAIN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str | None) -> bool:
    """Whether a chat template marks assistant turns with `{% generation %}` (not `add_generation_prompt`)."""
    return bool(template and _MARKER.search(template))
