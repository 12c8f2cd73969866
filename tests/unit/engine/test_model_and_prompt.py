"""Model loading errors are specific; prompts that do not fit fail instead of truncating."""

from __future__ import annotations

import pytest

from structspec.engine.model import load_model
from structspec.engine.model_files import ModelLoadError, converted_dir, default_gguf_path
from structspec.engine.prompt import DocumentTooLong, build_prompt


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "nope.gguf"), cache_dir=tmp_path)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path), cache_dir=tmp_path)


def test_default_model_is_converted_once_into_the_cache(tokenizer):
    from structspec.config import Settings

    target = converted_dir(default_gguf_path(), Settings.from_env().cache_dir)
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def test_prompt_contains_schema_and_document_in_the_chat_template(tokenizer):
    schema = {"type": "object", "properties": {"number": {"type": "integer", "description": "Invoice number"}}}
    ids = build_prompt(tokenizer, schema, "Invoice 42 from ACME", 8192)
    text = tokenizer.decode(ids)
    assert "- number (integer): Invoice number\n\nDocument:\nInvoice 42 from ACME" in text
    assert text.rstrip().endswith("assistant")


def test_document_longer_than_context_is_an_error_not_a_truncation(tokenizer):
    with pytest.raises(DocumentTooLong, match=r"prompt is \d+ tokens but the model's context is 512"):
        build_prompt(tokenizer, {"type": "object"}, "word " * 1000, 512)
