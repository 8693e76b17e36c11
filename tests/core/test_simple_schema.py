"""The fast check of simple JSON Schemas never says valid where jsonschema (Draft 2020-12) says invalid."""

from __future__ import annotations

from typing import Any

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from undolog_core._tools import simple_checker

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "b": {"type": "boolean"}},
     "additionalProperties": False},
    {"type": "object", "properties": {"v": {"type": ["string", "null"]}, "a": {"type": "array"},
                                      "o": {"type": "object"}, "any": {}}, "required": ["v", "any"]},
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)
args = st.dictionaries(st.sampled_from(["n", "s", "x", "b", "v", "a", "o", "any", "extra"]), json_values, max_size=6)


@settings(max_examples=300, deadline=None)
@given(args=args)
def test_valid_only_where_jsonschema_agrees(args: dict[str, Any]) -> None:
    for schema in SCHEMAS:
        check = simple_checker(schema)
        assert check is not None
        if check(args):
            assert jsonschema.Draft202012Validator(schema).is_valid(args), (schema, args)


def test_valid_arguments_take_the_fast_path_and_other_schemas_do_not() -> None:
    check = simple_checker(SCHEMAS[0])
    assert check is not None and check({"n": 1, "s": "x", "extra": [1]})
    assert not check({"n": True})  # a bool is not an integer to JSON Schema: left to jsonschema, which refuses it
    assert simple_checker({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}) is None
    assert simple_checker({"type": "object", "additionalProperties": {"type": "string"}}) is None
