"""Loading the model directory's tokenizer, shared by the actors (the tokenizer and the
detokenizer encode and decode; the scheduler decodes output tails for stop strings):
tokenizer.json itself (the Rust `tokenizers` library) for encode/decode on the hot path, the HF
tokenizer for chat templates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, path: str):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory never needs the hub
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path)
        # The file as written, not the HF class's rebuild of it: transformers rebuilds some
        # tokenizers (Qwen3.5) from vocab and merges and loses settings such as ignore_merges.
        file = Path(path) / "tokenizer.json"
        self._fast = (Tokenizer.from_file(str(file)) if file.is_file()
                      else getattr(self.hf, "backend_tokenizer", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def specials(self) -> frozenset[str]:
        """The added tokens' texts (`<tool_call>`, `<|im_end|>`...): a grammar names them as
        tokens, since the grammar library reads every added token as one, never as text."""
        if self._fast is not None:
            return frozenset(t.content for t in self._fast.get_added_tokens_decoder().values())
        return frozenset(self.hf.get_added_vocab())

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self.hf.decode(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Render a conversation and tokenize it, ending with the assistant's turn opened."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        text = self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=True, **kwargs)
        # The template already holds any BOS the model wants.
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(path: str) -> TextTokenizer:
    return TextTokenizer(path)


def load_decoder(path: str):
    """decode(ids) -> str without loading transformers (the scheduler only needs this)."""
    file = Path(path) / "tokenizer.json"
    if file.is_file():
        fast = Tokenizer.from_file(str(file))
        return lambda ids: fast.decode(ids, skip_special_tokens=False)
    return TextTokenizer(path).decode
