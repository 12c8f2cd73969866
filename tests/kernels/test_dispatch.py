"""Backend selection, argument validation and the no-triton fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kernel_cases import cu_from_lengths, random_batch

from structspec import kernels
from structspec.kernels.greedy import verify_greedy_torch, verify_greedy_triton
from structspec.kernels.sampling import verify_sampling_torch, verify_sampling_triton

ROOT = Path(__file__).resolve().parents[2]

GREEDY = {"torch": verify_greedy_torch, "triton": verify_greedy_triton}
SAMPLING = {"torch": verify_sampling_torch, "triton": verify_sampling_triton}


def small_case(vocab: int = 40):
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(gen, [2, 0, 1], vocab)
    temperature = torch.ones(3)
    accept_uniform = torch.full((3,), 0.5)
    sample_noise = torch.ones(3, vocab)  # a row per sequence
    return list(batch.args), [temperature, accept_uniform, sample_noise, None]


def test_resolve_backend() -> None:
    cpu = torch.device("cpu")
    assert kernels.resolve_backend("torch", cpu) == "torch"
    assert kernels.resolve_backend("triton", cpu) == "triton"
    assert kernels.resolve_backend("auto", cpu) == "triton"  # TRITON_INTERPRET=1 (conftest)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.resolve_backend("cuda", cpu)  # type: ignore[arg-type]


def test_auto_without_interpreter_or_cuda_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert kernels.resolve_backend("auto", torch.device("cuda")) == "triton"


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_dispatchers_agree(backend: str) -> None:
    args, extra = small_case()
    ref = verify_greedy_torch(*args)
    got = kernels.verify_greedy(*args, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    ref = verify_sampling_torch(*args, *extra)
    got = kernels.verify_sampling(*args, *extra, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    logits = args[0].clone()
    kernels.apply_bitmask_inplace(logits, args[1], backend=backend)
    expected = args[0].clone()
    kernels.apply_bitmask_inplace(expected, args[1], backend="torch")
    assert torch.equal(logits, expected)
    u, noise = kernels.make_sampling_randoms(cu_from_lengths([2, 1]), 9, [torch.Generator()] * 2, "cpu")
    assert u.shape == (3,) and noise.shape == (2, 9)


# (case id, argument index, make the bad argument, exception, message regex);
# indices refer to (logits, bitmask, draft_tokens, cu_num_draft).
BAD_LAYOUT = [
    ("logits dtype", 0, lambda a: a[0].double(), TypeError, "logits must have dtype"),
    ("logits not a tensor", 0, lambda a: a[0].tolist(), TypeError, "logits must be a torch.Tensor"),
    ("logits 1-D", 0, lambda a: a[0][0], ValueError, "logits must be 2-D"),
    ("logits rows", 0, lambda a: a[0][:-1], ValueError, "logits has 5 rows but"),
    ("logits column stride", 0, lambda a: a[0].t().contiguous().t(), ValueError, "contiguous rows"),
    ("bitmask dtype", 1, lambda a: a[1].to(torch.int64), TypeError, "bitmask must have dtype int32"),
    ("bitmask width", 1, lambda a: torch.cat([a[1], a[1]], 1), ValueError, r"bitmask must have shape \[6, 2\]"),
    ("draft dtype", 2, lambda a: a[2].float(), TypeError, "draft_tokens must have dtype int32 or int64"),
    ("draft out of vocab", 2, lambda a: a[2] + 1000, ValueError, r"draft_tokens must be token ids in \[0, 40\)"),
    ("cu dtype", 3, lambda a: a[3].long(), TypeError, "cu_num_draft must have dtype int32"),
    ("cu start", 3, lambda a: a[3] + 1, ValueError, r"cu_num_draft\[0\] must be 0"),
    ("cu decreasing", 3, lambda a: torch.tensor([0, 3, 2, 3], dtype=torch.int32), ValueError, "non-decreasing"),
    ("cu total", 3, lambda a: torch.tensor([0, 2, 2, 2], dtype=torch.int32), ValueError, r"cu_num_draft\[-1\] must"),
    ("cu length", 3, lambda a: a[3][:-1], ValueError, "logits has 6 rows but sum"),
    ("device", 2, lambda a: a[2].to("meta"), ValueError, "draft_tokens is on meta but logits is on cpu"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("index", "make_bad", "exc", "message"), [c[1:] for c in BAD_LAYOUT], ids=[c[0] for c in BAD_LAYOUT]
)
def test_layout_validation(backend: str, index: int, make_bad, exc: type, message: str) -> None:
    args, extra = small_case()
    args[index] = make_bad(args)
    with pytest.raises(exc, match=message):
        GREEDY[backend](*args)
    with pytest.raises(exc, match=message):
        SAMPLING[backend](*args, *extra)


# Same, with indices into (temperature, accept_uniform, sample_noise, draft_probs).
BAD_SAMPLING = [
    ("temperature dtype", 0, lambda e: e[0].double(), TypeError, "temperature must have dtype float32"),
    ("temperature shape", 0, lambda e: e[0][:2], ValueError, r"temperature must have shape \[3\]"),
    ("temperature zero", 0, lambda e: torch.zeros(3), ValueError, "temperature must be finite and > 0"),
    ("uniform shape", 1, lambda e: e[1][:1], ValueError, r"accept_uniform must have shape \[3\]"),
    ("noise dtype", 2, lambda e: e[2].half(), TypeError, "sample_noise must have dtype float32"),
    ("noise shape", 2, lambda e: e[2][:, :5], ValueError, r"sample_noise must have shape \[3, 40\]"),
    ("draft_probs shape", 3, lambda e: torch.ones(3, 41), ValueError, r"draft_probs must have shape \[3, 40\]"),
    ("draft_probs device", 3, lambda e: torch.ones(3, 40, device="meta"), ValueError, "draft_probs is on meta"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("index", "make_bad", "exc", "message"), [c[1:] for c in BAD_SAMPLING], ids=[c[0] for c in BAD_SAMPLING]
)
def test_sampling_validation(backend: str, index: int, make_bad, exc: type, message: str) -> None:
    args, extra = small_case()
    extra[index] = make_bad(extra)
    with pytest.raises(exc, match=message):
        SAMPLING[backend](*args, *extra)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bitmask_apply_validation(backend: str) -> None:
    logits = torch.zeros(2, 40)
    with pytest.raises(ValueError, match=r"bitmask must have shape \[2, 2\]"):
        kernels.apply_bitmask_inplace(logits, torch.zeros(2, 1, dtype=torch.int32), backend=backend)
    with pytest.raises(TypeError, match="logits must have dtype"):
        kernels.apply_bitmask_inplace(logits.long(), torch.zeros(2, 2, dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="bitmask is on meta"):
        kernels.apply_bitmask_inplace(logits, torch.zeros(2, 2, dtype=torch.int32, device="meta"), backend=backend)


def test_block_v_validation() -> None:
    args, _ = small_case()
    with pytest.raises(ValueError, match="block_v must be a power of two >= 32"):
        verify_greedy_triton(*args, block_v=48)


def test_torch_backend_works_without_triton() -> None:
    """With `import triton` failing, the torch path and "auto" still work and
    the triton backend explains itself."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from structspec import kernels
        logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
        bitmask = torch.tensor([[0b111], [0b110]], dtype=torch.int32)
        args = (logits, bitmask, torch.tensor([1]), torch.tensor([0, 1], dtype=torch.int32))
        out, acc = kernels.verify_greedy(*args)  # auto -> torch
        assert out.tolist() == [[1, 1]] and acc.tolist() == [1], (out, acc)
        assert kernels.resolve_backend("auto", torch.device("cpu")) == "torch"
        try:
            kernels.verify_greedy(*args, backend="triton")
        except RuntimeError as exc:
            assert "import triton" in str(exc), exc
        else:
            raise AssertionError("triton backend ran without triton")
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
