"""JSON schemas the constrained-decoding tests and benchmarks share.

Each exercises what clients ask of ``response_format`` most: required fields, enums, integer
bounds, nested objects, arrays with bounds, string lengths and patterns.
"""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 32},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 24},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "express"],
    "additionalProperties": False,
}

WEATHER_TOOL = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}


def _wide(n: int) -> dict:
    """A flat object of ``n`` required typed fields: a bigger grammar to compile."""
    kinds = [
        {"type": "string", "maxLength": 16},
        {"type": "integer", "minimum": -1000, "maximum": 1000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
    ]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


WIDE = _wide(40)

SCHEMAS = {"person": PERSON, "order": ORDER, "weather_tool": WEATHER_TOOL, "wide40": WIDE}
