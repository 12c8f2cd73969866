"""Token ids <-> bytes/text, shared by proposers and the decode loop."""

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

    def bytes_of(self, ids) -> bytes:
        return b"".join(self._bytes[i] for i in ids)

    def text_of(self, ids) -> str:
        return self.bytes_of(ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of `text` with no special tokens."""
        return self.hf.encode(text, add_special_tokens=False)


@lru_cache(maxsize=4)
def token_text(hf_tokenizer, vocab_size: int) -> TokenText:
    return TokenText(hf_tokenizer, vocab_size)
