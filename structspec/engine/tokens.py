"""Token ids <-> bytes/text, shared by proposers and the decode loop, and the plain-text
encoding of user text (documents, schemas) that never yields a control token."""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable


ENCODE_CACHE = 8192  # texts whose ids TokenText.encode remembers


class TokenText:
    """Exact bytes of every token (byte-level BPE tokens are not valid UTF-8 on their own)."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        from structspec.grammar.llguidance_backend import llguidance_tokenizer

        lt = llguidance_tokenizer(hf_tokenizer, vocab_size)
        self.hf = hf_tokenizer
        self.vocab_size = vocab_size
        grammar_special = {i for i in range(vocab_size) if lt.is_special_token(i)}  # no bytes for the grammar
        self._bytes = [b"" if i in grammar_special else lt.decode_bytes([i]) for i in range(vocab_size)]
        # Drafts are cut at these (step.propose): the control tokens, and any token the grammar
        # engine treats as special (for the default model the two sets are equal; a test checks).
        control = control_token_ids(hf_tokenizer.backend_tokenizer, hf_tokenizer.all_special_tokens)
        self.special = frozenset(grammar_special | {i for i in control if i < vocab_size})
        self._plain = plain_text_tokenizer(hf_tokenizer.backend_tokenizer)
        # Proposers encode the same short texts step after step (a schema's keys and
        # punctuation, a document's recurring phrases): remembered, not tokenized again.
        self._encoded = lru_cache(maxsize=ENCODE_CACHE)(self._encode)

    def bytes_of(self, ids) -> bytes:
        return b"".join(self._bytes[i] for i in ids)

    def text_of(self, ids) -> str:
        return self.bytes_of(ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of `text` as plain text: no special token is added, and the
        text of one ("<|im_end|>") is encoded as the characters it is made of. A new list each
        call (the ids of recent texts are remembered)."""
        return list(self._encoded(text))

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._plain.encode(text, add_special_tokens=False).ids)


def plain_text_tokenizer(tokenizer):
    """A copy of `tokenizer` (a `tokenizers.Tokenizer`) that encodes the text of its special
    tokens as ordinary text ("<|im_end|>" becomes "<", "|", "im", ...), never as the control
    token: how document and schema text is encoded (prompt.py, the proposers). A copy, so that
    no other user of the tokenizer sees the switch."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.encode_special_tokens = True
    return plain


def control_token_ids(tokenizer, named: Iterable[object] = ()) -> dict[int, str]:
    """{id: text} of the control tokens of `tokenizer` (a `tokenizers.Tokenizer`): its added
    tokens flagged special, and the tokens whose text is in `named` (transformers' bos, eos,
    unk, pad and additional special tokens, which a tokenizer may not flag). The one definition:
    a prompt refuses user text that would encode to one (prompt.py, and the API's count in
    api/services/doclen.py), and drafts are cut at one (TokenText.special)."""
    ids = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for text in named:
        if isinstance(text, str) and (i := tokenizer.token_to_id(text)) is not None:
            ids[i] = text
    return ids


@lru_cache(maxsize=4)
def token_text(hf_tokenizer, vocab_size: int) -> TokenText:
    return TokenText(hf_tokenizer, vocab_size)
