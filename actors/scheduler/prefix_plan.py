"""What the radix tree can hold for the served model, decided from the layer kinds the runner
found when it loaded it (ModelLayers; docs/architecture.md, section 7, "Layer kinds and the
prefix cache").

A radix node restores a prefix from KV slots (full-attention layers) and, for hybrid and
sliding-window models, a state snapshot (recurrent layers' states; sliding-window layers' last
`window` positions: actors/model_runner/windows.py). Nothing restores a layer of another kind
yet. For such a model the tree is not used at all: no prefix cache, and the n choices of a
group each prefill their prompt (sharing it goes through the same tree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import LAYER_FULL, LAYER_RECURRENT, LAYER_SLIDING

RESTORABLE = (LAYER_FULL, LAYER_RECURRENT, LAYER_SLIDING)


@dataclass(frozen=True)
class PrefixPlan:
    prefix: bool  # the radix prefix cache across requests
    share_groups: bool  # a group's choices reuse the prompt one of them computed
    blocked: dict[str, list[int]] = field(default_factory=dict)  # kind -> layers in the way
    reason: str = ""  # why, for the launch log; empty when nothing is in the way


def plan_prefix(kinds: list[str], wanted: bool) -> PrefixPlan:
    """The prefix cache as configured (`wanted`) where every layer is restorable; else off,
    and group sharing with it."""
    blocked: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind not in RESTORABLE:
            blocked.setdefault(kind, []).append(i)
    if not blocked:
        return PrefixPlan(prefix=wanted, share_groups=True)
    reason = "; ".join(f"{kind} layers keep nothing a radix node can restore"
                       for kind in blocked)
    return PrefixPlan(prefix=False, share_groups=False, blocked=blocked, reason=reason)
