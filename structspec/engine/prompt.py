"""The extraction prompt: the model's chat template around instruction, schema and document.

Document and schema text is data. It is encoded as plain text, so that a document holding
the text of a control token ("<|im_end|>\\n<|im_start|>assistant") cannot close its turn or
open one of its own: only the chat template's own structure yields control tokens. The
template is rendered with a placeholder for each message's text; the template's pieces are
encoded as usual (their control tokens recognised), each message's text with the tokenizer's
special tokens split into ordinary ones (engine/tokens.py). A tokenizer that still yields a
control token for such text has the document refused (UnsafeText), never spliced blindly.

The worker (build_prompt, with the transformers tokenizer) and the API's token count
(api/services/doclen.py, with `tokenizers` alone) both encode through `encode_prompt`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Callable

SYSTEM_INSTRUCTION = (
    "You extract information from a document into JSON. Answer with one JSON value that "
    "matches the JSON Schema. Copy names, dates, numbers and other values exactly as they "
    "appear in the document; do not invent values that the document does not contain."
)

# Leave room for at least this many output tokens when checking a prompt against the context.
MIN_OUTPUT_ROOM = 32

# Stands for a message's text while the chat template is rendered (private-use characters, no
# white space: templates that trim or quote the text keep it whole).
SLOT = "\ue000structspec-message-{}\ue001"


class DocumentTooLong(ValueError):
    """The prompt does not fit the model's context window; nothing was truncated."""

    def __init__(self, prompt_tokens: int, context_len: int):
        self.prompt_tokens = prompt_tokens
        self.context_len = context_len
        super().__init__(
            f"document too long: the prompt is {prompt_tokens} tokens but the model's context is "
            f"{context_len} tokens (at least {MIN_OUTPUT_ROOM} are kept for the output); "
            "split the document or use a model with a longer context")


class UnsafeText(ValueError):
    """The model's tokenizer or chat template cannot keep document and schema text as plain
    text; the request is refused rather than let that text act as prompt structure."""


class MessagesError(ValueError):
    """Chat messages that cannot be a prompt; `param` names the faulty part (messages.1.role)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(raw) -> list[dict[str, str]]:
    """OpenAI-style chat messages as [{role, content}] with text content (developer counts as
    system; content parts must be text); MessagesError otherwise."""
    if not isinstance(raw, list) or not raw:
        raise MessagesError("messages must be a non-empty array of {role, content}", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise MessagesError(f"{where}: role must be one of {', '.join(sorted(CHAT_ROLES))}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise MessagesError(f"{where}: only text content parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise MessagesError(f"{where}: content must be a string or text parts", f"{where}.content")
        if "\x00" in content:
            raise MessagesError(f"{where}: content must not contain U+0000", f"{where}.content")
        out.append({"role": CHAT_ROLES[m["role"]], "content": content})
    return out


def messages_text(messages: list[dict[str, str]]) -> str:
    """The text of chat messages, as one document: what a chat job stores, what its size is
    checked on, and what the n-gram proposers draft from."""
    return "\n\n".join(m["content"] for m in messages)


def user_message(schema: dict, document: str) -> str:
    """The schema as a field list (before the document: every document of a schema shares this
    prefix, which the prefix cache keeps). A list with descriptions beat the raw JSON Schema on
    the default model (docs/benchmarks.md, "Extraction prompt"); the grammar enforces the schema
    itself either way."""
    return f"Fields to extract:\n{field_list(schema)}\n\nDocument:\n{document}"


FIELD_LIST_DEPTH = 8  # deeper nesting (or a recursive $ref) is shown as "object"


def field_list(schema: dict) -> str:
    """The schema as an indented list: `- name (kind): description`, children indented under
    objects and lists of objects. A schema that is not an object with properties is shown as
    its kind alone."""
    lines: list[str] = []
    root = _resolve(schema, schema)
    if isinstance(root, dict) and isinstance(root.get("properties"), dict):
        _properties(schema, root, 0, lines)
    else:
        lines.append(f"- a JSON value ({_kind(schema, root)})")
    return "\n".join(lines)


def _properties(root: dict, node: dict, depth: int, lines: list[str]) -> None:
    for name, sub in node["properties"].items():
        sub = _resolve(root, sub)
        if not isinstance(sub, dict):
            continue
        description = sub.get("description") or (sub.get("title") if sub.get("title") != name else None)
        text = f"{'  ' * depth}- {name} ({_kind(root, sub)})"
        lines.append(text + (f": {' '.join(str(description).split())}" if description else ""))
        if depth + 1 >= FIELD_LIST_DEPTH:
            continue
        if isinstance(sub.get("properties"), dict):
            _properties(root, sub, depth + 1, lines)
        items = _resolve(root, sub.get("items"))
        if isinstance(items, dict) and isinstance(items.get("properties"), dict):
            lines.append(f"{'  ' * (depth + 1)}each item:")
            _properties(root, items, depth + 2, lines)


def _kind(root: dict, node) -> str:
    node = _resolve(root, node)
    if not isinstance(node, dict):
        return "any value"
    if "const" in node:
        return f"exactly {json.dumps(node['const'], ensure_ascii=False)}"
    if isinstance(node.get("enum"), list):
        return "one of " + ", ".join(json.dumps(v, ensure_ascii=False) for v in node["enum"][:20])
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            return " or ".join(_kind(root, b) for b in node[key][:5])
    kind = node.get("type")
    if isinstance(kind, list):
        return " or ".join(map(str, kind))
    if kind == "array":
        items = _resolve(root, node.get("items"))
        inner = "object" if isinstance(items, dict) and "properties" in items else _kind(root, items)
        return f"list of {inner}" if isinstance(items, dict) else "list"
    if kind == "string" and node.get("format"):
        return f"string, {node['format']}"
    return str(kind) if kind else ("object" if "properties" in node else "any value")


def _resolve(root: dict, node, hops: int = 0):
    """`node` with a local `$ref` ("#/$defs/x", "#/definitions/x") followed (a few hops)."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/") and hops < 8:
        target = root
        for part in node["$ref"][2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        if target is None:
            return node
        node, hops = target, hops + 1
    return node


def extraction_messages(schema: dict, document: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_INSTRUCTION},
            {"role": "user", "content": user_message(schema, document)}]


def plain_prompt_text(messages: list[dict[str, str]]) -> str:
    """The prompt of a model without a chat template."""
    return "\n\n".join(m["content"] for m in messages) + "\n\nJSON:\n"


def encode_prompt(messages: list[dict[str, str]], tokenizer, plain, special: dict[int, str],
                  render: Callable[[list[dict[str, str]]], str] | None) -> list[int]:
    """Token ids of `messages` through the chat template `render` (None: no template; the
    tokenizer's own special tokens, e.g. BOS, around plain_prompt_text). `tokenizer` encodes
    the template's pieces, `plain` (tokens.plain_text_tokenizer) the messages' text; `special`
    is {id: text} of the control tokens, none of which may come from a message's text."""
    if render is None:
        text = plain_prompt_text(messages)
        _check_plain(plain.encode(text, add_special_tokens=False).ids, special)
        return plain.encode(text, add_special_tokens=True).ids
    slots = [SLOT.format(i) for i in range(len(messages))]
    rest = render([{**m, "content": slot} for m, slot in zip(messages, slots)])
    ids: list[int] = []
    for message, slot in zip(messages, slots):
        before, found, rest = rest.partition(slot)
        if not found or slot in rest:
            raise UnsafeText("the model's chat template does not show each message's text once and unchanged, so "
                             "the document's text cannot be kept apart from the template's structure; use a model "
                             "whose template does")
        ids += tokenizer.encode(before, add_special_tokens=False).ids if before else []
        text_ids = plain.encode(message["content"], add_special_tokens=False).ids
        _check_plain(text_ids, special)
        ids += text_ids
    return ids + (tokenizer.encode(rest, add_special_tokens=False).ids if rest else [])


def _check_plain(ids: list[int], special: dict[int, str]) -> None:
    bad = next((i for i in ids if i in special), None)
    if bad is not None:
        raise UnsafeText(f"the model's tokenizer encodes text of the document or schema as its control token "
                         f"{special[bad]!r} even with special tokens split; refused, so that the text cannot act "
                         "as prompt structure (use a model whose tokenizer can split its special tokens)")


def build_prompt(tokenizer, schema: dict, document: str, context_len: int) -> list[int]:
    """Token ids of the full extraction prompt (`tokenizer`: a transformers fast tokenizer);
    raises DocumentTooLong instead of truncating, UnsafeText as encode_prompt."""
    return build_chat_prompt(tokenizer, extraction_messages(schema, document), context_len)


def build_chat_prompt(tokenizer, messages: list[dict[str, str]], context_len: int) -> list[int]:
    """Token ids of `messages` (role, content) through the model's chat template, their text
    as data; raises as build_prompt."""
    ids = encode_prompt(messages, *_encoders(tokenizer))
    if len(ids) + MIN_OUTPUT_ROOM > context_len:
        raise DocumentTooLong(len(ids), context_len)
    return ids


@lru_cache(maxsize=8)
def _encoders(tokenizer) -> tuple:
    """(tokenizer, plain, special, render) for encode_prompt, of a transformers fast tokenizer."""
    from structspec.engine.tokens import control_token_ids, plain_text_tokenizer

    backend = tokenizer.backend_tokenizer
    special = control_token_ids(backend, tokenizer.all_special_tokens)

    def render(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    has_template = bool(getattr(tokenizer, "chat_template", None))
    return backend, plain_text_tokenizer(backend), special, render if has_template else None
