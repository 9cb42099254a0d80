"""Prompts the served-parity tests share: scripts, emoji and a long one that is prefilled in
chunks."""

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
