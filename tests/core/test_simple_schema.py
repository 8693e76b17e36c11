"""The fast checks of simple JSON Schemas: never valid where jsonschema (Draft 2020-12) says invalid, and never "as
it is" where the args model would change a value (what lets ``ToolSpec.checked`` skip the model)."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from undolog_core._validation import _model_from_json_schema, as_is_checker, simple_checker
from undolog_core.errors import ArgumentsInvalid, InvalidDeclaration

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


SCHEMAS_AS_IS = [*SCHEMAS, {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                                          "s": {"type": "string"}, "b": {"type": "boolean"}},
                            "required": ["n"], "additionalProperties": True},
                 # Every property required, each of exact types: the copier's look-up path (no key view, no loop).
                 {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                  "required": ["s", "n"], "additionalProperties": False},
                 {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s", "s"]}]


@settings(max_examples=300, deadline=None)
@given(args=args)
@example(args={"s": "x"})  # the one draw that meets the invalid schema's model: failed now and then in CI before
def test_as_is_only_where_the_model_gives_the_arguments_back_unchanged(args: dict[str, Any]) -> None:
    for schema in SCHEMAS_AS_IS:
        as_is = as_is_checker(schema)
        assert as_is is not None
        if as_is(args):
            assert jsonschema.Draft202012Validator(schema).is_valid(args), (schema, args)
            try:
                jsonschema.Draft202012Validator.check_schema(schema)
            except jsonschema.SchemaError:
                # Not a valid JSON Schema (a "required" name twice): registration refuses it, naming what is wrong,
                # so the as-is path never meets it. (Reached only when hypothesis draws exactly {"s": <str>}.)
                with pytest.raises(InvalidDeclaration, match="non-unique"):
                    _model_from_json_schema("t", schema)
                continue
            model = _model_from_json_schema("t", schema)
            values = model.__pydantic_validator__.validate_python(args).model_dump(exclude_unset=True)
            assert values == args and {k: type(v) for k, v in values.items()} == {k: type(v) for k, v in args.items()}


def test_checked_skips_the_model_only_for_arguments_it_keeps_and_still_refuses_bad_ones(undolog: Any) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}, "x": {"type": "number"}}, "required": ["q"],
              "additionalProperties": False}
    spec = undolog.register_tool(lambda **kw: kw, name="search", tier="safe", args_schema=schema)
    calls: list[Any] = []
    real = spec._model_validate
    spec._model_validate = lambda a: calls.append(a) or real(a)
    args = {"q": "refund", "x": 2.5}
    values = spec.checked(args)
    assert values == args and values is not args and calls == []  # as it is: no model, a copy
    converted = spec.checked({"q": "refund", "x": 2})  # the model's conversion is kept: a number field takes floats
    assert converted == {"q": "refund", "x": 2.0} and type(converted["x"]) is float and len(calls) == 1
    for bad in ({"q": 5}, {"x": 1.0}, {"q": "a", "extra": 1}, {"q": True}):
        with pytest.raises(ArgumentsInvalid):
            spec.checked(bad)
    # A contract declared by a Python signature is not schema-declared: always through its model (defaults filled).
    assert spec._as_is is not None and undolog.register_tool(lambda q="x": q, name="sig", tier="safe")._as_is is None


def test_a_dict_subclass_is_taken_as_it_is_only_when_it_reads_as_a_dict(undolog: Any) -> None:
    # A framework's arguments (Semantic Kernel's KernelArguments) are a dict subclass that reads as a dict: checked as
    # they are and copied to a plain dict. One that overrides how its items are read is never taken as it is.
    class Arguments(dict):  # type: ignore[type-arg]
        execution_settings = None

    class Rewriting(dict):  # type: ignore[type-arg]
        def items(self) -> Any:
            return [(k, "rewritten") for k in self]

    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"],
              "additionalProperties": False}
    spec = undolog.register_tool(lambda **kw: kw, name="search", tier="safe", args_schema=schema)
    copy = spec.as_is_copy(Arguments(q="refund"))
    assert copy == {"q": "refund"} and type(copy) is dict
    assert spec.as_is_copy(Rewriting(q="refund")) is None and spec.as_is_copy(Arguments(q=5)) is None
    assert spec.as_is_copy(Arguments(q="refund", extra=1)) is None


# A COMPENSABLE call's decision takes arguments its schema-declared contract would keep as they are without the args
# model (Engine.intercept_spec, ToolSpec._as_is_json): the same values, snapshot, digest and refusals as through it.
TYPED = {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
                                          "b": {"type": "boolean"}, "z": {"type": "null"}},
         "required": ["s"], "additionalProperties": False}
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3)
           | st.sampled_from(["\ud800", "é", "a\x00"]))


def _decided(undolog: Any, spec: Any, args: dict[str, Any]) -> Any:
    """What the engine decides for ``args`` (the values run, the snapshot and digest pre-written), or its refusal."""
    written: list[tuple[Any, ...]] = []
    hot = undolog.engine.hot
    real = hot.prewrite

    def prewrite(*a: Any, **kw: Any) -> Any:
        written.append(a[6:8])  # args_text, digest
        return real(*a, **kw)

    hot.prewrite = prewrite
    try:
        d = undolog.engine.intercept_spec("as-is-" + str(id(args)), spec, args)
    except ArgumentsInvalid as exc:
        return "refused", exc.errors
    finally:
        del hot.prewrite
    undolog.engine.complete(d.effect_id, None)
    # (Sorted: the model gives its fields in the schema's order, the arguments' own order is kept as it is; neither
    # the tool's keyword arguments nor the canonical snapshot depend on it.)
    recent = undolog.engine.cached(d.session_id).recent[-1][2]
    return sorted((k, v, type(v)) for k, v in d.args.items()), written, sorted(recent.items())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(args=st.dictionaries(st.sampled_from(["s", "n", "x", "b", "z", "extra"]), scalars, max_size=5))
@example(args={"s": "a", "x": float("nan"), "n": 3})
@example(args={"s": "\ud800"})
@example(args={"s": "a", "x": float("inf"), "b": True, "z": None})
def test_a_logged_call_taken_as_it_is_decides_as_through_the_model(undolog: Any, args: dict[str, Any]) -> None:
    spec = undolog.register_tool(lambda **kw: kw, name="typed", tier="compensable", compensation="typed_undo",
                                 args_schema=TYPED)
    assert spec._as_is_json is not None
    as_is = _decided(undolog, spec, args)
    spec._as_is_json = None  # the model's path, as before
    through_model = _decided(undolog, spec, args)
    assert str(as_is) == str(through_model), (as_is, through_model)  # (str: a NaN is never equal to itself)


def test_a_logged_calls_arguments_kept_as_they_are_skip_the_args_model(undolog: Any) -> None:
    """Counted: a COMPENSABLE call whose arguments are of the exact types of a schema-declared contract runs no args
    model (validation, and the two dumps of values and snapshot); others do, and a schema with a property of any type
    (which may hold objects that are not JSON) always does."""
    spec = undolog.register_tool(lambda **kw: kw, name="typed", tier="compensable", compensation="typed_undo",
                                 args_schema=TYPED)
    loose = undolog.register_tool(lambda **kw: kw, name="loose", tier="compensable", compensation="typed_undo",
                                  args_schema={"type": "object", "properties": {"s": {"type": "string"}, "any": {}}})
    calls: list[Any] = []
    for s in (spec, loose):
        real = s._model_validate
        s._model_validate = lambda a, real=real: calls.append(a) or real(a)
    engine = undolog.engine
    d = engine.intercept_spec("as-is-1", spec, {"s": "a", "x": 2.5})
    assert calls == [] and d.args == {"s": "a", "x": 2.5}
    d2 = engine.intercept_spec("as-is-1", spec, {"s": "a", "x": 2})  # a number field converts an int: the model
    assert len(calls) == 1 and d2.args == {"s": "a", "x": 2.0} and type(d2.args["x"]) is float
    d3 = engine.intercept_spec("as-is-1", loose, {"s": "a", "any": [1]})
    assert len(calls) == 2 and loose._as_is_json is None and loose._as_is_copy is not None
    for done in (d, d2, d3):
        engine.complete(done.effect_id, None)
