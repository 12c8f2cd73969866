"""Compile every kernel ahead of time for NVIDIA targets, without a GPU.

Run as a script in a process where TRITON_INTERPRET is unset (the interpreter
replaces @triton.jit functions, so nothing would be compiled):

    python tests/kernels/compile_for_gpu.py [--logit-dtypes fp32,bf16,fp16] [ARCH ...]

ARCH defaults to 80 90 (A100, H100).

It lowers each kernel through TTIR/TTGIR/LLVM/PTX to a cubin with the ptxas
bundled in the triton wheel, which catches code the interpreter accepts but
the compiler rejects.  Prints one line per kernel variant and exits non-zero
on the first failure.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from structspec.kernels.attention import _append_kv_kernel, _attend_kernel  # noqa: E402
from structspec.kernels.bitmask import _apply_bitmask_kernel  # noqa: E402
from structspec.kernels.greedy import _verify_greedy_kernel  # noqa: E402
from structspec.kernels.sampling import _verify_sampling_kernel  # noqa: E402

def _signature(kernel, pointer_types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointer_types[name]
        else:
            sig[name] = SCALARS.get(name, "i32")
    return sig


SCALARS = {"scale": "fp32"}  # every other scalar argument is an int32


def attention_variants(dtypes: list[str]):
    """The ragged attention's two kernels, at SmolLM2's head size (64) and Llama's (128)."""
    for ty in dtypes:
        tables = {"k_table_ptr": "*i64", "v_table_ptr": "*i64", "seg_ptr": "*i64"}
        for dim in (64, 128):
            sizes = {"D": dim, "DV": dim, "BLOCK_D": dim, "BLOCK_DV": dim}
            yield _append_kv_kernel, tables | {"key_ptr": f"*{ty}", "value_ptr": f"*{ty}"}, sizes | {"BLOCK_R": 16}, 4
            for window in (False, True):
                yield _attend_kernel, tables | {"q_ptr": f"*{ty}", "out_ptr": f"*{ty}"}, sizes | {
                    "GROUP": 3, "BLOCK_M": 16, "BLOCK_N": 64, "HAS_WINDOW": window, "DOT_FP32": ty == "fp32"}, 4


def variants(logit_dtypes: list[str]):
    for logit_ty in logit_dtypes:
        ptrs = {"logits_ptr": f"*{logit_ty}", "bitmask_ptr": "*i32"}
        yield _apply_bitmask_kernel, ptrs, {"BLOCK_V": 1024}, 4
        ptrs = ptrs | {
            "draft_tokens_ptr": "*i64",
            "cu_num_draft_ptr": "*i32",
            "output_tokens_ptr": "*i32",
            "num_accepted_ptr": "*i32",
            "temperature_ptr": "*fp32",
            "accept_uniform_ptr": "*fp32",
            "sample_noise_ptr": "*fp32",
            "draft_probs_ptr": "*fp32",
        }
        yield _verify_greedy_kernel, ptrs, {"BLOCK_V": 4096}, 8
        for has_q in (False, True):
            yield _verify_sampling_kernel, ptrs, {"HAS_DRAFT_PROBS": has_q, "BLOCK_V": 2048}, 8


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", type=int, default=[80, 90])
    parser.add_argument("--logit-dtypes", default="fp32,bf16,fp16", help="also the attention's q/k/v dtypes")
    args = parser.parse_args(argv)
    dtypes = args.logit_dtypes.split(",")
    for arch in args.archs:
        for kernel, ptrs, consts, num_warps in [*variants(dtypes), *attention_variants(dtypes)]:
            sig = _signature(kernel, ptrs, consts)
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
            ptx = compiled.asm["ptx"]
            # An approximate fp32 divide would break agreement with torch.
            approx_div = sorted(set(re.findall(r"div\.(?:approx|full)\.f32", ptx)))
            flags = {k: v for k, v in consts.items() if k.isupper()}
            data = ptrs.get("logits_ptr") or ptrs.get("q_ptr") or ptrs.get("key_ptr")
            print(
                f"sm_{arch} {kernel.__name__} {data} {flags}: "
                f"cubin {len(compiled.asm['cubin'])} B, approx div: {approx_div or 'none'}"
            )
            if approx_div:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
