"""The graph's processes as Linux's /proc shows them: a launcher's children and the titles
they carry (mas-launch, mas-tokenizer, ...), for the tests and benchmarks that look at them.
The readers are actors/titles.py's: the runner finds its sibling actors with them too."""

from __future__ import annotations

from actors.titles import children, title

__all__ = ["children", "title"]
