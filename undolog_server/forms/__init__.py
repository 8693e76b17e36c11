"""Edit forms generated from a tool's JSON Schema: one generator for the dashboard, Slack modals and email pages.

An approver who modifies a request edits the tool's arguments. Instead of raw JSON, :func:`build` turns the tool's
arguments schema into form fields, :func:`parse` turns what was submitted back into arguments (validated against
the same schema with ``jsonschema``; every error names its field), and :func:`diff` lists what the edit changes
against the proposed arguments, so the approver sees the change before submitting it.

What gets an input of its own:

- ``enum`` (and ``const``): a choice among the listed values (each option's value is the value's JSON text);
- ``integer`` / ``number``: a number input, with ``minimum``, ``maximum`` (and exclusive ones) and ``multipleOf``;
- ``boolean``: a choice of ``true`` / ``false`` (and "not set" when the field is optional);
- ``string``: a text input, with ``pattern``, ``minLength`` and ``maxLength`` shown and checked;
- an ``object`` with ``properties``, nested up to ``max_depth`` levels: a group of the fields above;
- an ``array`` of one of the scalars above: one item per line.

Anything else (``oneOf``, tuples, arrays of objects, objects deeper than ``max_depth`` or without properties,
a ``$ref`` that is not local) falls back to a JSON text field, validated against its part of the schema. A field
whose schema is ``anyOf`` / a type list of one kind and ``null`` is that kind, nullable (what pydantic writes for
``Optional[X]``); local ``$ref`` s (``#/$defs/...``) are followed.

Every field's input is named by a JSON Pointer to the argument (``/amount``, ``/address/city``), so a submitted
mapping ``{name: text}`` is all :func:`parse` needs, whatever the channel: an HTML form's fields, a Slack modal's
``view.state.values`` flattened to ``{block_id: value}``, an email confirmation page's POST.

Rendering: ``templates/_schema_form.html`` holds two Jinja macros, ``schema_fields(form.fields, submitted)`` (the
inputs, each with its hint; ``submitted`` keeps what was typed when an edit is sent back with an error) and
``diff_table(diff(...))``; the dashboard's request page uses both. :func:`request_schema` reads the schema of the
tool revision a request was raised under. The Slack modal's blocks come from :meth:`Form.leaves`
(``undolog_server.slack_blocks.modal_blocks``).

The package, by job: ``fields`` (the fields, their errors and names), ``schema`` (a JSON Schema read into fields;
the request's schema), ``values`` (submitted texts read back and validated), ``form`` (``Form``, ``build``,
``parse``), ``changes`` (``Change``, ``diff``).

Example:
    >>> schema = {"type": "object", "required": ["to", "amount"], "properties": {
    ...     "to": {"type": "string", "pattern": "^[a-z]+$"},
    ...     "amount": {"type": "number", "minimum": 0, "maximum": 100},
    ...     "currency": {"enum": ["EUR", "USD"]}}}
    >>> form = build(schema, {"to": "acme", "amount": 10.0, "currency": "EUR"})
    >>> [(f.name, f.kind, f.value) for f in form.fields]
    [('/to', 'string', 'acme'), ('/amount', 'number', '10.0'), ('/currency', 'enum', '"EUR"')]
    >>> edited = parse(schema, {"/to": "acme", "/amount": "90", "/currency": '"USD"'})
    >>> edited
    {'to': 'acme', 'amount': 90, 'currency': 'USD'}
    >>> [(c.name, c.before, c.after) for c in diff({"to": "acme", "amount": 10.0, "currency": "EUR"}, edited)]
    [('/amount', 10.0, 90), ('/currency', 'EUR', 'USD')]
"""

from .changes import Change, diff
from .fields import MAX_DEPTH, WHOLE, FieldError, FieldKind, FormField, FormInvalid, dom_id, pointer
from .form import Form, build, parse
from .schema import request_schema

__all__ = [
    "MAX_DEPTH",
    "WHOLE",
    "Change",
    "FieldError",
    "FieldKind",
    "Form",
    "FormField",
    "FormInvalid",
    "build",
    "diff",
    "dom_id",
    "parse",
    "pointer",
    "request_schema",
]
