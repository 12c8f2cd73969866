"""engine/packed.py: linear layers through oneDNN's prepacked weights on a CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from structspec.engine.packed import PackedLinear, bf16_unpackable, can_pack, pack_linears


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48), nn.SiLU(), nn.Linear(48, 40, bias=False))


# oneDNN packs bf16 weights only on CPUs with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT: on others
# (AVX2-only ones, e.g. AMD Zen 3) a bf16 model keeps its plain layers, which these tests check
BF16_PACKS = bf16_unpackable() is None


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.0), (torch.float32, 1e-5)])
def test_packed_layers_compute_what_f_linear_computes(dtype, tol):
    """bf16: bit-identical; fp32: within the last bits (oneDNN sums in another order)."""
    model = small_model().to(dtype)
    x = torch.randn(2, 7, 64).to(dtype)
    with torch.inference_mode():
        want = model(x)
        if dtype == torch.bfloat16 and not BF16_PACKS:
            assert pack_linears(model) == 0 and type(model[0]) is nn.Linear
            assert "cannot pack bf16" in can_pack(model)
            return
        assert pack_linears(model) == 2 and all(isinstance(m, PackedLinear) for m in (model[0], model[2]))
        got = model(x)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max() <= tol


def test_the_packed_copy_follows_the_weight_through_copies_casts_and_in_place_changes():
    model = small_model()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        pack_linears(model)
        ref = model(x)
        assert (copy.deepcopy(model)(x) - ref).abs().max() < 1e-5  # the opaque packed tensor is not copied
        half = copy.deepcopy(model).to(torch.bfloat16)
        out = half(x.bfloat16())
        assert out.dtype == torch.bfloat16
        assert half[0].packed.dtype == torch.bfloat16 if BF16_PACKS else half[0].packed is None  # F.linear
        assert (out.float() - ref).abs().max() < 0.05
        model[0].weight.mul_(2)  # in place: repacked on the next call
        plain = nn.functional.linear(nn.functional.silu(nn.functional.linear(x, model[0].weight, model[0].bias)),
                                     model[2].weight)
        assert (model(x) - plain).abs().max() < 1e-5


def test_unpacking_restores_plain_layers_sharing_the_weights():
    from structspec.engine.packed import unpack_linears

    model = small_model()
    weight = model[0].weight
    x = torch.randn(4, 64)
    with torch.inference_mode():
        pack_linears(model)
        packed_out = model(x)
        unpack_linears(model)
        assert type(model[0]) is nn.Linear and model[0].weight is weight and model[2].bias is None
        assert (model(x) - packed_out).abs().max() < 1e-5
        assert pack_linears(model) == 2 and pack_linears(model) == 2  # packing twice counts, does not nest


def test_a_model_off_the_cpu_or_in_fp16_is_left_alone():
    model = small_model().to(torch.float16)
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear


def test_the_engine_packs_the_model_and_its_bf16_outputs_are_those_of_the_plain_layers(tiny_normal_loaded,
                                                                                       caplog):
    """The engine packs by default (engine_packed_linear), and unpacks a model another engine
    packed when the setting is off; in bf16 a packed run emits exactly the tokens of an
    unpacked one, since every packed layer is bit-identical: on a CPU without bf16 units
    oneDNN's (emulated) bf16 sums some shapes otherwise (the tiny model's lm_head, on the AVX-512
    Xeon without AVX512-BF16), and the check at packing keeps such a layer plain, saying so."""
    import logging

    from structspec.engine.engine import Engine, Request
    from structspec.engine.model import cpu_has_bf16_matmul, from_model
    from structspec.options import RequestOptions

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    docs = ["Ada Lovelace, 36", "Alan Turing, 41", "Grace Hopper, 85"]
    opts = RequestOptions(strategy="composite", draft_len=4, max_tokens=40, verbatim=True)
    outputs = []
    for packed in (False, True):
        model = copy.deepcopy(tiny_normal_loaded.model).to(torch.bfloat16)
        loaded = from_model(model, tiny_normal_loaded.tokenizer, name="tiny bf16")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="structspec.engine.packed"):
            engine = Engine(loaded, engine_max_seqs=3, engine_packed_linear=packed, kernel_backend="torch")
        assert (engine.packed_linears > 0) == (packed and BF16_PACKS)
        # the model's own layer the engine runs beside the lean forward's: packed, or refused by the check
        assert isinstance(model.lm_head, PackedLinear) == (packed and BF16_PACKS) or (
            packed and not cpu_has_bf16_matmul() and "lm_head: ValueError: output differs from F.linear" in caplog.text)
        outputs.append([r.tokens for r in engine.run([Request(schema, d, opts) for d in docs])])
    assert outputs[0] == outputs[1] and all(outputs[0])
