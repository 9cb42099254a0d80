"""The tool schemas the API tests offer the model, one per shape of argument: an enum and a
bounded integer, and an enum alone. Every endpoint's tests use the same two, so a forced call
is checked against the same schema on chat completions, messages and responses."""

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}

# JSON schemas for constrained decoding: nested objects, enums, bounded arrays.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5,
                                                         "maximum": 5},
                                                   "y": {"type": "boolean"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1,
                 "maxItems": 3}},
     "required": ["color", "point", "tags"], "additionalProperties": False},
]
