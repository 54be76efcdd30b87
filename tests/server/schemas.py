"""JSON schemas for the structured-output tests: hand-written ones for each keyword the grammar
supports, and seeded combinations of them (nested, enums, arrays, required and optional)."""
import random

FIELDS = [
    {"type": "string"},
    {"type": "string", "maxLength": 12},
    {"type": "string", "minLength": 3, "maxLength": 8},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "integer"},
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "integer", "minimum": -50, "exclusiveMaximum": 50},
    {"type": "number"},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
    {"type": ["string", "null"]},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
]

NAMES = ["id", "name", "count", "score", "tags", "kind", "when", "owner", "ok", "note", "items", "meta"]


def combo(rng, depth):
    n = rng.randint(1, 4)
    names = rng.sample(NAMES, n)
    props = {}
    for k in names:
        if depth < 2 and rng.random() < 0.2:
            props[k] = combo(rng, depth + 1)
        elif depth < 2 and rng.random() < 0.1:
            props[k] = {"type": "array", "items": combo(rng, depth + 1), "maxItems": 2}
        else:
            props[k] = rng.choice(FIELDS)
    required = [k for k in names if rng.random() < 0.7]
    s = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.5:
        s["additionalProperties"] = False
    return s


def schemas():
    out = [{"type": "object", "properties": {"v": f}, "required": ["v"]} for f in FIELDS]
    out.append({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
                "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}}, "required": ["from", "to"]})
    out.append({"type": "array", "items": {"type": "object", "properties": {"q": {"type": "string"}, "a": {"type": "integer"}}, "required": ["q", "a"]},
                "minItems": 1, "maxItems": 3})
    out.append({"type": "string", "pattern": "^(yes|no)$"})
    out.append({"type": "integer", "minimum": 1900, "maximum": 2100})
    rng = random.Random(2026)
    while len(out) < 60:
        out.append(combo(rng, 0))
    return out


# Two tools whose parameters the untrained model can only fill from the grammar (enums, bounded
# integers), so forced calls always complete.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}},
]
