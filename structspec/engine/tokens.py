"""Token ids <-> bytes/text, shared by proposers and the decode loop, and the plain-text
encoding of user text (documents, schemas) that never yields a control token."""

from __future__ import annotations

from functools import lru_cache


class TokenText:
    """Exact bytes of every token (byte-level BPE tokens are not valid UTF-8 on their own)."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        import llguidance.hf

        lt = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._bytes = [b"" if lt.is_special_token(i) else lt.decode_bytes([i]) for i in range(vocab_size)]
        self.special = frozenset(i for i in range(vocab_size) if lt.is_special_token(i))
        self._plain = plain_text_tokenizer(hf_tokenizer.backend_tokenizer)

    def bytes_of(self, ids) -> bytes:
        return b"".join(self._bytes[i] for i in ids)

    def text_of(self, ids) -> str:
        return self.bytes_of(ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of `text` as plain text: no special token is added, and the
        text of one ("<|im_end|>") is encoded as the characters it is made of."""
        return self._plain.encode(text, add_special_tokens=False).ids


def plain_text_tokenizer(tokenizer):
    """A copy of `tokenizer` (a `tokenizers.Tokenizer`) that encodes the text of its special
    tokens as ordinary text ("<|im_end|>" becomes "<", "|", "im", ...), never as the control
    token: how document and schema text is encoded (prompt.py, the proposers). A copy, so that
    no other user of the tokenizer sees the switch."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.encode_special_tokens = True
    return plain


def special_token_ids(tokenizer) -> dict[int, str]:
    """{id: text} of the special (control) tokens of `tokenizer` (a `tokenizers.Tokenizer`)."""
    return {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


@lru_cache(maxsize=4)
def token_text(hf_tokenizer, vocab_size: int) -> TokenText:
    return TokenText(hf_tokenizer, vocab_size)
