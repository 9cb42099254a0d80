"""A model's chat template, rendered the way Hugging Face tokenizers render it, with jinja2
alone: the tokenizer actor serves chat without importing transformers (~250 MB of a process
that otherwise holds one tokenizer). What HF templates expect of the environment: blocks
trimmed and left-stripped, loop controls, a `tojson` that leaves non-ASCII and HTML characters
alone, `raise_exception`, `strftime_now`, the `{% generation %}` tag (it marks assistant text
for training masks; rendering ignores it) and the special tokens' texts as variables."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The special tokens HF hands a template by name, when the tokenizer files set them.
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token", "additional_special_tokens")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: the body, as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # Sandboxed: a template comes with a downloaded model and is code we did not write.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    def __init__(self, templates: dict[str, str], specials: dict[str, Any]):
        """`templates`: by name ("default", "tool_use", ...); `specials`: SPECIAL_KEYS' texts."""
        self.templates = templates
        self.specials = specials

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The conversation as text, ending with the assistant's turn opened. Template errors
        (and raise_exception) come out as jinja2's TemplateError."""
        name = "tool_use" if tools and "tool_use" in self.templates else "default"
        if name not in self.templates:
            raise ValueError(f"this model's chat templates ({', '.join(self.templates)}) have "
                             "no default")
        # The request's own keys win over the tokenizer's, as in HF.
        values = {**self.specials, "documents": None, **kwargs, "messages": messages,
                  "tools": tools, "add_generation_prompt": add_generation_prompt}
        return _compile(self.templates[name]).render(**values)


def _text(token: Any) -> str | None:
    """A special token as the tokenizer files write it: a string or an AddedToken's dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The folder's templates by name. Newer checkpoints keep the template in its own file,
    which wins over the copy in tokenizer_config.json."""
    found: Any = None
    if (folder / "chat_template.jinja").is_file():
        found = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        found = _read_json(folder / "chat_template.json").get("chat_template") \
            or config.get("chat_template")
    if isinstance(found, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t["name"]: t["template"] for t in found
                 if isinstance(t, dict) and isinstance(t.get("template"), str)}
    else:
        named = {"default": found} if isinstance(found, str) and found else {}
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            named.setdefault(file.stem, file.read_text(encoding="utf-8"))
    return named


def read_chat_template(path: str) -> ChatTemplate | None:
    """The model folder's chat template and special tokens; None when it has no template."""
    folder = Path(path)
    config = _read_json(folder / "tokenizer_config.json")
    templates = _templates(folder, config)
    if not templates:
        return None
    fallback = _read_json(folder / "special_tokens_map.json")
    specials: dict[str, Any] = {}
    for key in SPECIAL_KEYS:
        value = config.get(key, fallback.get(key))
        if key == "additional_special_tokens":
            if isinstance(value, list):
                specials[key] = [t for t in map(_text, value) if t is not None]
        elif (text := _text(value)) is not None:
            specials[key] = text
    return ChatTemplate(templates, specials)
