"""Loading the model directory's tokenizer, shared by the actors (the tokenizer and the
detokenizer encode and decode; the scheduler decodes output tails for stop strings):
tokenizer.json itself through the Rust `tokenizers` library, and the chat template through
jinja2 (models/chat_template.py). transformers is imported only for a model that ships no
tokenizer.json (a SentencePiece model file alone): it costs a process ~250 MB."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from models.chat_template import read_chat_template


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system. Parsing a tokenizer.json (18 MB for
    Qwen's 151k vocabulary) peaks at ~160 MB of heap that glibc keeps after the parse; the
    tokenizer itself holds ~50 MB of it."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def _hf_tokenizer(path: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory never needs the hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class TextTokenizer:
    def __init__(self, path: str):
        # The file as written, not the HF class's rebuild of it: transformers rebuilds some
        # tokenizers (Qwen3.5) from vocab and merges and loses settings such as ignore_merges.
        file = Path(path) / "tokenizer.json"
        self.hf = None if file.is_file() else _hf_tokenizer(path)
        self._fast = (Tokenizer.from_file(str(file)) if self.hf is None
                      else getattr(self.hf, "backend_tokenizer", None))
        self.template = read_chat_template(path)
        return_freed_heap()

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

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """Render a conversation and tokenize it, ending with the assistant's turn opened.
        continue_final_message (vLLM's name; Anthropic's assistant prefill): a final assistant
        message is the start of the reply, which goes on from its last character."""
        if self.template is None:
            raise ValueError("this model's tokenizer has no chat template")
        start = ""
        if continue_final_message and messages and messages[-1].get("role") == "assistant":
            *messages, last = messages
            start = last.get("content") or ""
        text = self.template.render(messages, **kwargs) + start
        # The template already holds any BOS the model wants.
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(path: str) -> TextTokenizer:
    return TextTokenizer(path)


def load_decoder(path: str):
    """decode(ids) -> str, without the chat template or transformers (the scheduler only needs
    this)."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return TextTokenizer(path).decode
    fast = Tokenizer.from_file(str(file))
    return_freed_heap()
    return lambda ids: fast.decode(ids, skip_special_tokens=False)
