"""A tokenizer actor whose grammar compile takes SLOW_S seconds for one marked JSON schema
(`"title": "slow"`) and is the real one for every other constraint: the entry point the
tokenizer rig spawns (tests/support/rig.py, `entry`) to show that a slow compile holds up
neither the streams nor other requests. The compile is replaced in the child, where
actors/tokenizer/compiles.py looks it up at call time."""

from __future__ import annotations

import json
import time

SLOW_S = 5.0
SLOW_TITLE = "slow"


def _is_slow(kind: str, source: str) -> bool:
    if kind != "json_schema":
        return False
    try:
        schema = json.loads(source)
    except ValueError:
        return False
    return isinstance(schema, dict) and schema.get("title") == SLOW_TITLE


def main(cfg, addrs, model) -> None:
    from actors import constraints
    from actors.tokenizer import actor

    real = constraints.compile_constraint

    def compile_constraint(kind, source, specials):
        if _is_slow(kind, source):
            time.sleep(SLOW_S)  # off the event loop, on the compile's own thread
        return real(kind, source, specials)

    constraints.compile_constraint = compile_constraint
    actor.main(cfg, addrs, model)
