"""The tool schemas the API tests offer the model, one per shape of argument: an enum and a
bounded integer, and an enum alone. Every endpoint's tests use the same two, so a forced call
is checked against the same schema on chat completions, messages and responses."""

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
