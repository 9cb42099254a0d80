"""Process titles: `ps` and `top` show mas-launch, mas-tokenizer, mas-scheduler, mas-runner and
mas-detokenizer instead of five identical python command lines."""

from __future__ import annotations


def set_title(name: str) -> None:
    """This process's title (its argv as /proc/PID/cmdline and ps show it). Without the
    setproctitle package the title stays as it was, silently: it is a convenience."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(name)
