"""Invariant 1: speculative greedy output is token-identical to plain constrained greedy output.

For every strategy and every draft length, including drafts that are fully rejected,
fully accepted, run past the end of the grammar, or are cut by max_tokens. One request at a
time here; test_batched.py checks the same in batches, against many documents and the
default model.
"""

from __future__ import annotations

import jsonschema

import pytest

from structspec.options import STRATEGIES, RequestOptions
from tests.conftest import allowed_tokens, deepjsoneval_rows, unavailable

SPECULATIVE = [s for s in STRATEGIES if s != "none"]
RECEIPT = {
    "type": "object",
    "properties": {
        "merchant": {"type": "string"},
        "date": {"type": "string"},
        "total": {"type": "number"},
        "paid": {"enum": ["cash", "card", "voucher"]},
    },
    "required": ["merchant", "date", "total", "paid"],
}
RECEIPT_TEXT = "SUNRISE MART\n12 Jalan Ampang\nDate: 2023-04-18\nTOTAL 45.90\nPaid by card"


def run(engine, schema, text, strategy="none", draft_len=8, max_tokens=48, proposer=None):
    return engine.extract(schema, text, RequestOptions(strategy=strategy, draft_len=draft_len,
                                                       max_tokens=max_tokens), proposer=proposer)


class OracleProposer:
    """Drafts the known greedy continuation (then `junk` extra tokens): every draft is accepted."""

    name = "oracle"

    def __init__(self, expected: list[int], junk: list[int] = ()):
        self.expected = expected + list(junk)

    def propose(self, ctx, k):
        done = self.position(ctx)
        return self.expected[done:done + k]

    def position(self, ctx):
        # Output so far is a prefix of `expected`; find how many tokens it covers by bytes.
        text = ctx.output_text.encode()
        covered, n = b"", 0
        while len(covered) < len(text) and n < len(self.expected):
            covered += ctx.tokens.bytes_of([self.expected[n]])
            n += 1
        return n


class WrongProposer:
    """Drafts a grammar-valid token that greedy would not pick: every draft is rejected at 0."""

    name = "wrong"

    def __init__(self, expected: list[int]):
        self.oracle = OracleProposer(expected)

    def propose(self, ctx, k):
        import torch

        n = self.oracle.position(ctx)
        want = self.oracle.expected[n] if n < len(self.oracle.expected) else -1
        mask = torch.zeros((1, (ctx.tokens.vocab_size + 31) // 32), dtype=torch.int32)
        ctx.matcher.fill_bitmask(mask, 0)
        for tok in allowed_tokens(mask[0], ctx.tokens.hf.all_special_ids):
            if tok != want:
                return [tok]
        return []


@pytest.mark.parametrize("draft_len", [1, 2, 5, 16])
def test_every_draft_len_matches_none(tiny_engine, draft_len):
    base = run(tiny_engine, RECEIPT, RECEIPT_TEXT, max_tokens=64)
    for strategy in SPECULATIVE:
        res = run(tiny_engine, RECEIPT, RECEIPT_TEXT, strategy, draft_len=draft_len, max_tokens=64)
        assert res.tokens == base.tokens, strategy


def test_fully_accepted_drafts_match_and_save_passes(tiny_engine):
    base = run(tiny_engine, RECEIPT, RECEIPT_TEXT, max_tokens=64)
    res = run(tiny_engine, RECEIPT, RECEIPT_TEXT, draft_len=8, max_tokens=64,
              proposer=OracleProposer(base.tokens))
    assert res.tokens == base.tokens
    assert res.stats.accepted == res.stats.proposed > 0
    # Each pass yields k accepted + 1 bonus token, except the last.
    assert res.stats.target_passes <= -(-len(base.tokens) // 9) + 1


def test_fully_rejected_drafts_match(tiny_engine):
    base = run(tiny_engine, RECEIPT, RECEIPT_TEXT, max_tokens=40)
    res = run(tiny_engine, RECEIPT, RECEIPT_TEXT, max_tokens=40, proposer=WrongProposer(base.tokens))
    assert res.tokens == base.tokens
    assert res.stats.proposed > 0 and res.stats.accepted == 0
    assert res.stats.target_passes == len(base.tokens)


def test_draft_past_end_of_grammar_is_cut(tiny_engine, tokenizer):
    schema = {"type": "object", "properties": {"paid": {"enum": ["cash", "card"]}}, "required": ["paid"]}
    base = run(tiny_engine, schema, RECEIPT_TEXT, max_tokens=32)
    assert base.status == "succeeded" and base.stats.stop_reason == "grammar"
    junk = tokenizer.encode(' and more text {"x": 1}', add_special_tokens=False)
    res = run(tiny_engine, schema, RECEIPT_TEXT, draft_len=16, max_tokens=32,
              proposer=OracleProposer(base.tokens, junk))
    assert res.tokens == base.tokens
    assert res.status == "succeeded"
    # The whole answer is drafted and accepted in one pass (the bonus token is EOS);
    # the junk after the closing brace is cut by the grammar and never verified.
    assert res.stats.accepted == res.stats.proposed == len(base.tokens)
    assert res.stats.target_passes == 1 and res.stats.stop_reason == "eos"


@pytest.mark.parametrize("max_tokens", [1, 5, 13])
def test_max_tokens_hit_mid_draft(tiny_engine, max_tokens):
    full = run(tiny_engine, RECEIPT, RECEIPT_TEXT, max_tokens=64)
    assert len(full.tokens) > max_tokens
    base = run(tiny_engine, RECEIPT, RECEIPT_TEXT, max_tokens=max_tokens)
    assert base.tokens == full.tokens[:max_tokens]
    assert base.status == "truncated" and "max_tokens" in base.error
    for proposer in (OracleProposer(full.tokens), None):
        res = run(tiny_engine, RECEIPT, RECEIPT_TEXT, "composite", draft_len=8, max_tokens=max_tokens,
                  proposer=proposer)
        assert res.tokens == base.tokens
        assert res.status == "truncated"


def test_document_with_no_ngram_matches(tiny_engine):
    text = "\u2603\u2603\u2603"  # nothing the output could share three characters with
    base = run(tiny_engine, RECEIPT, text)
    res = run(tiny_engine, RECEIPT, text, "ngram")
    assert res.tokens == base.tokens


def test_reused_prompt_kv_gives_the_same_output_as_a_fresh_prefill(tiny_loaded):
    """Benchmarks reuse one prompt's KV for every strategy of a document (Request.reuse_prompt);
    the rolled-back slots of earlier runs must not leak into later ones."""
    from structspec.engine.engine import Engine, Request

    fresh, memo = Engine(tiny_loaded, kernel_backend="torch"), Engine(tiny_loaded, kernel_backend="torch")
    rows = deepjsoneval_rows(2)
    for row in rows:
        base = run(fresh, row["schema"], row["text"], max_tokens=32)
        for i, strategy in enumerate(("none", "composite", "ngram", "none")):
            opts = RequestOptions(strategy=strategy, draft_len=8, max_tokens=32)
            [res] = memo.run([Request(row["schema"], row["text"], opts, reuse_prompt=True)])
            assert res.tokens == base.tokens, (row["id"], strategy)
            prompt = res.stats.prompt_tokens - 1  # the last prompt token is fed by the first decode step
            # the first run computes the prompt (the second document: past the start it shares with
            # the first's cached prefix, the instruction at least), the later ones take all of it
            if i == 0:
                assert res.stats.prefill_tokens + res.stats.prefix_tokens == prompt
                assert (res.stats.prefix_tokens == 0) == (row is rows[0]), res.stats.prefix_tokens
            else:
                assert (res.stats.prefill_tokens, res.stats.prefix_tokens) == (0, prompt)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_prompt_that_begins_as_a_cached_one_reuses_that_start_with_a_fresh_prefills_output(tiny_loaded, backend):
    """Two schemas whose prompts share the instruction and first field: once the first's prefix
    is cached, the second copies the start they share (the native attention then reads it from
    the entry, whose buffers are longer than that start) and computes the rest of its prompt;
    its output is a fresh engine's."""
    from structspec.engine.engine import Engine

    name_age = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]}
    name_city = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                 "required": ["name", "city"]}
    doc = "Ada Lovelace, 36, of London"
    warm = Engine(tiny_loaded, kernel_backend=backend)
    first = run(warm, name_age, doc, max_tokens=24)
    got = run(warm, name_city, doc, max_tokens=24)
    want = run(Engine(tiny_loaded, kernel_backend=backend), name_city, doc, max_tokens=24)
    assert got.tokens == want.tokens and got.tokens
    prompt = got.stats.prompt_tokens - 1  # the last prompt token is fed by the first decode step
    assert first.stats.prefix_tokens == 0 and want.stats.prefix_tokens == 0
    assert got.stats.prefix_tokens >= 16 and got.stats.prefill_tokens > 0
    assert got.stats.prefix_tokens + got.stats.prefill_tokens == prompt
    again = run(warm, name_city, doc, max_tokens=24)  # now its own prefix is cached: all of it is taken
    assert again.tokens == want.tokens and again.stats.prefix_tokens > got.stats.prefix_tokens


def test_successful_results_validate_against_schema(tiny_engine):
    schema = {"type": "object", "properties": {"paid": {"enum": ["cash", "card"]},
                                               "n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["paid", "ok"]}
    seen = 0
    for strategy in STRATEGIES:
        res = run(tiny_engine, schema, RECEIPT_TEXT, strategy, max_tokens=64)
        if res.status == "succeeded":
            seen += 1
            # jsonschema itself, not the engine's own validate_instance, is the oracle
            jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(res.value)
    assert seen == len(STRATEGIES)


def test_kernels_through_triton_interpreter_match_none(tiny_loaded, monkeypatch):
    """The engine's verification through the Triton kernels (interpreted on CPU). Its attention
    stays on torch: interpreted, the Triton attention took ~95% of this test's 4 minutes, and
    tests/kernels/test_attention.py runs the engine on it."""
    import os

    import torch

    from structspec.engine import runner
    from structspec.engine.engine import Engine

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        unavailable("Triton needs CUDA or TRITON_INTERPRET=1 set before triton is imported "
                    "(make test sets it)")
    monkeypatch.setattr(runner, "attention_backend", lambda kernel_backend, device: "torch")
    triton_engine = Engine(tiny_loaded, kernel_backend="triton")
    assert triton_engine.kernel_backend == "triton" and triton_engine.runner.attention == "torch"
    torch_engine = Engine(tiny_loaded, kernel_backend="torch")
    for row in deepjsoneval_rows(2):
        base = run(torch_engine, row["schema"], row["text"], max_tokens=24)
        for strategy in ("none", "composite"):
            res = run(triton_engine, row["schema"], row["text"], strategy, max_tokens=24)
            assert res.tokens == base.tokens, strategy
