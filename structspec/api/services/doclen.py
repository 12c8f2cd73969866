"""Document length in tokens, at submission: does the prompt fit the model's context?

The API process holds no model and must not import torch (transformers does), so this uses the
model's own tokenizer files through `tokenizers` and renders its chat template with jinja2 as
transformers does; the count equals the worker's (structspec/engine/prompt.py: build_prompt),
which stays the authority: it fails a job whose prompt does not fit, naming both counts.

The files are used where they already are on this machine, never downloaded or converted: a
local model directory, a Hugging Face id in the local hub cache, or, for a GGUF model (the
default), its safetensors conversion in STRUCTSPEC_CACHE_DIR, which the first worker on this
machine writes. Until they are found (looked for again every minute) only the worker checks.
`document_token_check = "off"` leaves the check to the worker altogether.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from structspec.config import Settings
from structspec.engine.prompt import MIN_OUTPUT_ROOM, UnsafeText, encode_prompt, extraction_messages

log = logging.getLogger(__name__)

RETRY_S = 60.0  # how long "no tokenizer files here" is remembered
CHECKS = ("auto", "off")


def model_files(spec: str, cache_dir: Path) -> Path | None:
    """The directory with the model's config.json and tokenizer.json, if present locally."""
    from structspec.engine.model_files import DEFAULT_MODEL, ModelLoadError, converted_dir, default_gguf_path

    try:
        if spec in (DEFAULT_MODEL, "", None):
            directory = converted_dir(default_gguf_path(), Path(cache_dir))
        elif spec.endswith(".gguf"):
            gguf = Path(spec).expanduser()
            directory = converted_dir(gguf, Path(cache_dir)) if gguf.is_file() else None
        elif Path(spec).expanduser().is_dir():
            directory = Path(spec).expanduser()
        else:
            directory = _hub_snapshot(spec)
    except (ModelLoadError, OSError):
        return None
    if directory is None or not (directory / "tokenizer.json").is_file() or not (directory / "config.json").is_file():
        return None
    return directory


def _hub_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True,
                                      allow_patterns=["config.json", "tokenizer*", "chat_template*",
                                                      "special_tokens_map.json"]))
    except Exception:  # not cached, not a valid id, hub library missing
        return None


class PromptCounter:
    """Counts the tokens of the extraction prompt with the model's tokenizer, without torch."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        from structspec.engine.tokens import control_token_ids, plain_text_tokenizer

        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.plain = plain_text_tokenizer(self.tokenizer)
        config = json.loads((directory / "config.json").read_text())
        self.context_len = int(config.get("max_position_embeddings") or 2048)  # as model.from_model
        tok_config = _read_json(directory / "tokenizer_config.json")
        template = tok_config.get("chat_template")
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.special_text = {k: _token_text(v) for k, v in tok_config.items() if k.endswith("_token")}
        self.special = control_token_ids(self.tokenizer, self.special_text.values())
        self.template = _compile(template) if template else None

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                    **self.special_text)

    def prompt_tokens(self, schema: dict, document: str) -> int:
        """Tokens of the prompt exactly as build_prompt encodes it; raises UnsafeText as it does."""
        render = self._render if self.template is not None else None
        return len(encode_prompt(extraction_messages(schema, document), self.tokenizer, self.plain, self.special,
                                 render))

    def document_tokens(self, document: str) -> int:
        return len(self.plain.encode(document, add_special_tokens=False).ids)


class DocumentLengthChecker:
    """One per API process: finds and loads the tokenizer lazily, keeps it."""

    def __init__(self, settings: Settings, clock=time.monotonic):
        if settings.document_token_check not in CHECKS:
            raise ValueError(f"STRUCTSPEC_DOCUMENT_TOKEN_CHECK={settings.document_token_check!r}: "
                             f"use one of {', '.join(CHECKS)}")
        self.settings = settings
        self.clock = clock
        self._counter: PromptCounter | None = None
        self._missing_until = float("-inf")
        self._lock = threading.Lock()

    def counter(self) -> PromptCounter | None:
        if self.settings.document_token_check == "off":
            return None
        with self._lock:
            if self._counter is None and self.clock() >= self._missing_until:
                directory = model_files(self.settings.model, self.settings.cache_dir)
                try:
                    self._counter = PromptCounter(directory) if directory is not None else None
                except Exception as e:  # unreadable or unusual files: the worker still checks
                    log.warning("cannot count tokens for model %r in %s: %s", self.settings.model, directory, e)
                if self._counter is None:
                    self._missing_until = self.clock() + RETRY_S
                    log.info("no tokenizer files for model %r on this machine; document length in tokens "
                             "is checked by the worker only", self.settings.model)
            return self._counter

    def problems(self, schema: dict, documents: Sequence[str]) -> list[str | None]:
        """For each document: None if its prompt fits the model's context (or no tokenizer is
        at hand), else the reason, with both counts."""
        counter = self.counter()
        if counter is None:
            return [None] * len(documents)
        context = counter.context_len
        out: list[str | None] = []
        for document in documents:
            try:
                total = counter.prompt_tokens(schema, document)
            except UnsafeText as e:
                out.append(str(e))
                continue
            if total + MIN_OUTPUT_ROOM <= context:
                out.append(None)
                continue
            doc = counter.document_tokens(document)
            out.append(f"document is {doc} tokens; with the prompt around it ({total - doc} tokens: instructions "
                       f"and schema) it needs {total} of the model's {context}-token context, which must keep "
                       f"at least {MIN_OUTPUT_ROOM} tokens for the output (the output is also capped by "
                       f"max_tokens); split the document")
        return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def _compile(template: str):
    """The chat template in a sandbox configured as transformers configures it."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
