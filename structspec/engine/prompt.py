"""The extraction prompt: the model's chat template around instruction, schema and document."""

from __future__ import annotations

import json

SYSTEM_INSTRUCTION = (
    "You extract information from a document into JSON. Answer with one JSON value that "
    "matches the JSON Schema. Copy names, dates, numbers and other values exactly as they "
    "appear in the document; do not invent values that the document does not contain."
)

# Leave room for at least this many output tokens when checking a prompt against the context.
MIN_OUTPUT_ROOM = 32


class DocumentTooLong(ValueError):
    """The prompt does not fit the model's context window; nothing was truncated."""

    def __init__(self, prompt_tokens: int, context_len: int):
        self.prompt_tokens = prompt_tokens
        self.context_len = context_len
        super().__init__(
            f"document too long: the prompt is {prompt_tokens} tokens but the model's context is "
            f"{context_len} tokens (at least {MIN_OUTPUT_ROOM} are kept for the output); "
            "split the document or use a model with a longer context")


def user_message(schema: dict, document: str) -> str:
    schema_text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return f"JSON Schema:\n{schema_text}\n\nDocument:\n{document}"


def build_prompt(tokenizer, schema: dict, document: str, context_len: int) -> list[int]:
    """Token ids of the full prompt; raises DocumentTooLong instead of truncating."""
    messages = [
        {"role": "system", "content": SYSTEM_INSTRUCTION},
        {"role": "user", "content": user_message(schema, document)},
    ]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        ids = list(ids)
    else:
        text = f"{SYSTEM_INSTRUCTION}\n\n{messages[1]['content']}\n\nJSON:\n"
        ids = tokenizer.encode(text)
    if len(ids) + MIN_OUTPUT_ROOM > context_len:
        raise DocumentTooLong(len(ids), context_len)
    return ids
