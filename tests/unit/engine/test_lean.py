"""engine/lean.py: the lean forward computes the model's own logits, in fewer operator calls."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from structspec.engine.kv_cache import Segment
from structspec.engine.lean import LeanForward, unsupported
from structspec.engine.packed import PackedLinear, bf16_unpackable
from structspec.engine.runner import BatchedRunner, StepInputs, make_runner

BF16_PACKS = bf16_unpackable() is None  # oneDNN packs bf16 weights on this CPU (engine/packed.py)


def llama(dtype=torch.float32, seed: int = 7, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, **config)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def steps(runner: BatchedRunner, first: int = 9, logits_rows=None):
    """Logits of three passes over three sequences, as the engine makes them: first chunks of
    two prompts (`first` and 6 rows), then one decode row of the first beside a 3-row
    verification of the second and the first chunk of a third, then 2 + 1 rows. Every row's
    logits, or those of `logits_rows` (a list of each pass's row indices)."""
    slots = [runner.make_slot(max(64, first + 16)) for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, 299, (n,), generator=gen)  # noqa: E731
    plans = [[(0, first), (1, 6)], [(0, 1), (1, 3), (2, 5)], [(0, 2), (2, 1)]]
    out = []
    for plan in plans:
        segs, tokens, positions, start = [], [], [], 0
        for b, rows in plan:
            past = slots[b].length
            segs.append(Segment(slots[b], start, rows, past))
            tokens.append(ids(rows))
            positions.append(torch.arange(past, past + rows))
            start += rows
        wanted = torch.arange(start) if logits_rows is None else torch.tensor(logits_rows[len(out)], dtype=torch.long)
        out.append(runner.forward(StepInputs(torch.cat(tokens), torch.cat(positions), segs, wanted)))
    return out


# each pass's logits rows where only some are asked for: none (a pass of prompt chunks alone, as the
# engine's are), the leading rows (the engine's decode rows) and rows spread over the pass
SOME_ROWS = [[], [0, 1, 2, 3], [0, 2]]


def some_rows_match_all_rows(make, exact: bool) -> None:
    """A pass asked for SOME_ROWS' logits (the lean forward then runs its last layer's o projection
    and MLP over those rows alone) gives the full pass's logits at those rows: bit for bit where
    every kernel's rows are independent of each other (`exact`), else within fp32's last bits; and
    the passes after it, which read the keys and values it wrote, agree too."""
    want = steps(make())
    got = steps(make(), logits_rows=SOME_ROWS)
    for g, w, rows in zip(got, want, SOME_ROWS):
        w = w[rows]
        assert g.shape == w.shape and g.dtype == w.dtype
        if exact or not rows:  # (no rows: the shapes said it all)
            assert torch.equal(g, w)
        else:
            assert (g.float() - w.float()).abs().max() <= 1e-5 * w.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pack", [True, False])
def test_lean_logits_are_the_models_own(dtype, pack):
    """bf16: bit-identical to the model's own forward through the same ragged attention (same
    GEMMs, same rounding steps); fp32: within the last bits (the fused GEMMs sum in another
    order). Packed or not, for prefill chunks, decode rows and verification rows in one pass."""
    model = llama(dtype)
    plain = make_runner(model, "torch")
    want = steps(plain)
    lean_runner = make_runner(model, "torch", lean=True, pack=pack)
    assert lean_runner.lean is not None
    assert (lean_runner.lean.packed_linears() > 0) == (pack and (dtype == torch.float32 or BF16_PACKS))
    got = steps(lean_runner)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if dtype == torch.bfloat16:
            assert torch.equal(g, w)
        else:
            assert (g - w).abs().max() <= 1e-5 * w.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pack", [True, False])
def test_the_last_layer_runs_only_the_rows_asked_for(dtype, pack):
    """Through torch's operators (oneDNN's GEMMs, the torch attention): the same logits at the rows
    asked for, within fp32's last bits (oneDNN's blocking may follow the row count)."""
    model = llama(dtype)
    some_rows_match_all_rows(lambda: make_runner(model, "torch", lean=True, pack=pack), exact=False)


def test_the_model_keeps_its_weights_and_its_own_forward():
    """The fused weights are the projections' memory: the model's own forward still gives what
    it gave before, and no projection weight was copied."""
    model = llama()
    ids = torch.randint(1, 299, (1, 11))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    runner = make_runner(model, "torch", lean=True, pack=True)
    layer, lean_layer = model.model.layers[0], runner.lean.layers[0]
    fused = lean_layer.qkv.weight
    assert layer.self_attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert layer.self_attn.k_proj.weight.data_ptr() == fused[64:].data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() == lean_layer.gate_up.weight[96:].data_ptr()
    assert not any(isinstance(m, PackedLinear) for m in layer.modules())  # the lean forward holds the packing
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_projection_biases_are_fused_too():
    """Projection biases (attention_bias: q/k/v/o; mlp_bias: gate/up/down) are added as the model adds them."""
    model = llama(attention_bias=True, mlp_bias=True)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    want = steps(make_runner(model, "torch"))
    runner = make_runner(model, "torch", lean=True, pack=True)
    assert runner.lean is not None and runner.lean.layers[0].qkv.bias is not None
    for g, w in zip(steps(runner), want):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()


def test_models_of_another_shape_run_their_own_forward(caplog):
    gelu = llama(hidden_act="gelu")
    assert "activation" in unsupported(gelu)
    with caplog.at_level(logging.INFO):
        runner = make_runner(gelu, "torch", lean=True, pack=True)
    assert runner.lean is None and "lean forward does not serve it" in caplog.text
    windowed = llama()
    for layer in windowed.model.layers:
        layer.self_attn.sliding_window = 4
    assert "sliding" in unsupported(windowed)
    normed = llama()
    normed.model.layers[1].self_attn.q_norm = torch.nn.Identity()
    assert "q_norm" in unsupported(normed)


def test_a_lean_forward_that_disagrees_is_dropped(monkeypatch, caplog):
    """The start-up check compares the lean logits with the model's own; on a mismatch the
    engine keeps the model's forward, with its layers packed again."""
    model = llama()
    real = LeanForward.__call__
    monkeypatch.setattr(LeanForward, "__call__", lambda self, *a: real(self, *a) + 1.0)
    with caplog.at_level(logging.WARNING):
        runner = make_runner(model, "torch", lean=True, pack=True)
    assert runner.lean is None and "lean forward failed its check" in caplog.text
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear)


def test_the_engine_reports_its_forward_and_emits_the_same_tokens(tiny_normal_loaded):
    """bf16, near-tie logits (transformers' default initialisation): the engine through the lean
    forward emits exactly the tokens of the engine through the model's own (bit-identical logits)."""
    from structspec.engine.engine import Engine, Request
    from structspec.engine.model import from_model
    from structspec.options import RequestOptions

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    docs = ["Ada Lovelace, 36", "Alan Turing, 41", "Grace Hopper, 85"]
    opts = RequestOptions(strategy="composite", draft_len=4, max_tokens=40, verbatim=True)
    outputs = []
    for lean in (False, True):
        model = copy.deepcopy(tiny_normal_loaded.model).to(torch.bfloat16)
        engine = Engine(from_model(model, tiny_normal_loaded.tokenizer, name="tiny bf16"), engine_max_seqs=3,
                        engine_lean_forward=lean, kernel_backend="torch")
        assert engine.forward_name == ("lean" if lean else "model") and (engine.packed_linears > 0) == BF16_PACKS
        outputs.append([r.tokens for r in engine.run([Request(schema, d, opts) for d in docs])])
    assert outputs[0] == outputs[1] and all(outputs[0])
