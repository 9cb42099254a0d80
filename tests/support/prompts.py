"""Prompts the served-parity tests share: scripts, emoji and a long one that is prefilled in
chunks."""

from protocol.messages import KV_PAGE

LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(100))
PROMPTS = [
    "Hello world",
    "The capital of France is",
    "中文的自然语言处理很有趣，我们今天来讨论",
    "日本語とemoji 🎉🚀 mixed together: ",
    "👨‍👩‍👧 family 🇯🇵 flag ✨",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    LONG,
    "Q: What is 2 + 2?\nA:",
]


def tight_budget(ids: list[list[int]], max_new: int) -> int:
    """memory.kv_tokens for the two-wave runs (half the prompts and a stream of the first,
    then the rest once something decodes): the first wave's pages and two more fit, its
    growth does not (retraction), and any one request alone always fits."""
    pages = [-(-len(p) // KV_PAGE) for p in ids]
    first_wave = sum(pages[:len(ids) // 2]) + pages[0]
    alone = -(-(max(map(len, ids)) + max_new) // KV_PAGE)
    return KV_PAGE * max(first_wave + 2, alone)
