"""Edit forms generated from a tool's JSON Schema (undolog_server.forms): the generator, parsing back with
field-named errors, the diff, and the dashboard's Modify form in a real browser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from undolog_core import ApprovalPending, ToolTier
from undolog_server import forms

from .conftest import Desk

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


class Address(BaseModel):
    city: str
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class PayInvoiceArgs(BaseModel):
    """The arguments of ``pay_invoice``: one of each kind the form generator renders, and a JSON fallback."""

    model_config = ConfigDict(extra="forbid")

    vendor: str = Field(pattern=r"^[a-z]+$")
    amount: float = Field(ge=1, le=5000)
    installments: int = Field(ge=1, le=12)
    currency: Literal["EUR", "USD", "GBP"]
    urgent: bool
    address: Address
    cc: list[str]
    extra: dict[str, Any]


def pay_invoice(**args: Any) -> dict[str, Any]:
    """Pay an invoice."""
    return {"paid": args["amount"]}


def _register(undolog: Any) -> None:
    # The schema is given as a model: constraints written as Annotated[..., Field(...)] in a signature are not kept
    # in the recorded schema (reported separately).
    undolog.register_tool(pay_invoice, name="pay_invoice", tier=ToolTier.IRREVERSIBLE, reason="Pays a vendor's invoice",
                          risk_tags=["billing"], args_schema=PayInvoiceArgs)


PROPOSED = {"vendor": "acme", "amount": 250.0, "installments": 1, "currency": "EUR", "urgent": False,
            "address": {"city": "Paris", "postcode": "75001"}, "cc": ["ops@acme.test"], "extra": {"po": 7}}


def _schema() -> dict[str, Any]:
    """The arguments schema UndoLog records for ``pay_invoice`` (what a request's edit form is built from)."""
    from undolog_core._tools import json_schema_of

    return json_schema_of(PayInvoiceArgs)


def test_every_supported_kind_gets_its_input_and_the_rest_falls_back_to_json() -> None:
    form = forms.build(_schema(), PROPOSED)
    by = {f.name: f for f in _walk(form.fields)}
    assert by["/vendor"].kind == "string" and by["/vendor"].pattern == "^[a-z]+$" and by["/vendor"].value == "acme"
    assert by["/amount"].kind == "number" and (by["/amount"].minimum, by["/amount"].maximum) == (1, 5000)
    assert by["/installments"].kind == "integer" and by["/installments"].step == "1"
    assert by["/currency"].kind == "enum" and [o[1] for o in by["/currency"].options] == ["EUR", "USD", "GBP"]
    assert by["/urgent"].kind == "boolean" and by["/urgent"].value == "false"
    assert by["/address"].kind == "object" and [c.name for c in by["/address"].children] == [
        "/address/city", "/address/postcode"]  # through pydantic's $ref
    assert by["/cc"].kind == "array" and by["/cc"].item_kind == "string" and by["/cc"].value == "ops@acme.test"
    assert by["/extra"].kind == "json" and by["/extra"].fallback_reason and '"po": 7' in by["/extra"].value
    assert [f.name for f in form.leaves()] == ["/vendor", "/amount", "/installments", "/currency", "/urgent",
                                              "/address/city", "/address/postcode", "/cc", "/extra"]


def _walk(fields: tuple[forms.FormField, ...]) -> list[forms.FormField]:
    out = []
    for f in fields:
        out.append(f)
        out.extend(_walk(f.children))
    return out


def _submitted(**over: str) -> dict[str, str]:
    base = {f.name: f.value for f in forms.build(_schema(), PROPOSED).leaves()}
    return {**base, **over}


def test_unchanged_fields_parse_back_to_the_proposed_arguments() -> None:
    assert forms.parse(_schema(), _submitted(), original=PROPOSED) == PROPOSED
    assert forms.diff(PROPOSED, forms.parse(_schema(), _submitted(), original=PROPOSED)) == []


def test_an_edit_parses_and_its_diff_names_each_change() -> None:
    edited = forms.parse(_schema(), _submitted(**{"/amount": "120.5", "/currency": '"USD"', "/urgent": "true",
                                                  "/address/city": "Lyon", "/cc": "a@x.test\nb@x.test\n",
                                                  "/extra": "{}"}), original=PROPOSED)
    assert edited == {**PROPOSED, "amount": 120.5, "currency": "USD", "urgent": True,
                      "address": {"city": "Lyon", "postcode": "75001"}, "cc": ["a@x.test", "b@x.test"], "extra": {}}
    changes = {c.name: (c.kind, c.before_text, c.after_text) for c in forms.diff(PROPOSED, edited)}
    assert changes == {"/amount": ("changed", "250.0", "120.5"), "/currency": ("changed", '"EUR"', '"USD"'),
                       "/urgent": ("changed", "false", "true"), "/address/city": ("changed", '"Paris"', '"Lyon"'),
                       "/cc": ("changed", '["ops@acme.test"]', '["a@x.test", "b@x.test"]'),
                       "/extra/po": ("removed", "7", "")}


@pytest.mark.parametrize(("over", "name", "words"), [
    ({"/vendor": "ACME!"}, "/vendor", "does not match"),
    ({"/amount": "9000"}, "/amount", "maximum"),
    ({"/amount": "lots"}, "/amount", "must be a number"),
    ({"/installments": "2.5"}, "/installments", "whole number"),
    ({"/currency": '"JPY"'}, "/currency", "must be one of"),
    ({"/urgent": "maybe"}, "/urgent", "true or false"),
    ({"/address/postcode": "12"}, "/address/postcode", "does not match"),
    ({"/extra": "{bad"}, "/extra", "not valid JSON"),
    ({"/extra": "[1]"}, "/extra", "is not of type 'object'"),
    ({"/amount": ""}, "/amount", "required"),
    ({"/extra": "NaN"}, "/extra", "not valid JSON"),
])
def test_bad_values_are_refused_naming_the_field(over: dict[str, str], name: str, words: str) -> None:
    with pytest.raises(forms.FormInvalid) as got:
        forms.parse(_schema(), _submitted(**over), original=PROPOSED)
    [err] = got.value.errors
    assert err.name == name and words in err.message, err
    assert got.value.code == "form_invalid" and got.value.message.startswith("the edited arguments are invalid")


def test_optional_nullable_and_deep_fields() -> None:
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"type": "object", "properties": {"d": {"type": "object", "properties": {"e": {"type": "integer"}}}}}}}}},
        "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}], "default": None},
        "flag": {"type": "boolean"},
        "counts": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "level": {"enum": [1, 2, 3]},
        "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    }}
    form = forms.build(schema, {"a": {"b": {"c": {"d": {"e": 1}}}}, "note": None})
    by = {f.name: f for f in _walk(form.fields)}
    assert by["/a/b/c"].kind == "object" and by["/a/b/c/d"].kind == "json"  # deeper than MAX_DEPTH
    assert by["/note"].kind == "string" and by["/note"].nullable
    assert by["/either"].kind == "json" and by["/level"].options[0] == ("1", "1")
    got = forms.parse(schema, {"/a/b/c/d": '{"e": 2}', "/note": "", "/flag": "", "/counts": "3\n 4\n\n",
                               "/level": "2"}, original={"note": None})
    assert got == {"a": {"b": {"c": {"d": {"e": 2}}}}, "note": None, "counts": [3, 4], "level": 2}
    with pytest.raises(forms.FormInvalid) as bad:
        forms.parse(schema, {"/a/b/c/d": "{}", "/counts": "1\n-1"})
    assert bad.value.errors[0].name == "/counts" and "minimum" in bad.value.errors[0].message


def test_a_schema_that_is_not_an_object_is_one_json_field() -> None:
    form = forms.build({}, {"x": 1})
    [f] = form.fields
    assert f.name == forms.WHOLE and f.kind == "json"
    assert forms.parse({}, {forms.WHOLE: '{"x": 2}'}) == {"x": 2}
    with pytest.raises(forms.FormInvalid):
        forms.parse({}, {forms.WHOLE: "[]"})


def test_names_are_json_pointers_and_ids_are_safe() -> None:
    schema = {"type": "object", "properties": {"a/b": {"type": "string"}, "c d": {"type": "integer"}}}
    names = [f.name for f in forms.build(schema, {}).fields]
    assert names == ["/a~1b", "/c d"] and [forms.dom_id(n) for n in names] == ["arg-a.2fb", "arg-c.20d"]
    assert forms.parse(schema, {"/a~1b": "x", "/c d": "3"}) == {"a/b": "x", "c d": 3}


# ------------------------------------------------------------------------------------------------ the dashboard


def _pending_invoice(desk: Desk) -> str:
    _register(desk.undolog)
    s = desk.session()
    with s:
        try:
            s.call_sync("pay_invoice", call_id="inv-1", **PROPOSED)
        except ApprovalPending as p:
            return p.approval_request_id
    raise AssertionError("expected an approval request")


@pytest.mark.browser
def test_browser_modify_form_from_the_schema_with_errors_fallback_and_diff(desk: Desk) -> None:
    from playwright.sync_api import expect, sync_playwright

    from .test_dashboard import CHROMIUM, CHROMIUM_ARGS

    rid = _pending_invoice(desk)
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
            page.set_default_timeout(15000)
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.goto(desk.url + "/ui/login")
            page.fill("#api_key", desk.token("admin"))
            page.click("button[type=submit]")
            page.goto(f"{desk.url}/ui/approvals/{rid}")
            # One input per kind, filled with the proposed arguments.
            expect(page.locator("#arg-vendor")).to_have_value("acme")
            expect(page.locator("#arg-vendor")).to_have_attribute("data-pattern", "^[a-z]+$")
            expect(page.locator("#arg-amount")).to_have_attribute("type", "number")
            expect(page.locator("#arg-amount")).to_have_attribute("max", "5000")
            expect(page.locator("#arg-installments")).to_have_attribute("step", "1")
            expect(page.locator("#arg-currency option")).to_have_count(3)
            expect(page.locator("#arg-currency")).to_have_value('"EUR"')
            expect(page.locator("#arg-urgent")).to_have_value("false")
            expect(page.locator("fieldset#arg-address #arg-address-postcode")).to_have_value("75001")
            expect(page.locator("textarea#arg-cc")).to_have_value("ops@acme.test")
            expect(page.locator("textarea#arg-extra.json")).to_contain_text('"po": 7')
            # The JSON fallback is validated: invalid JSON is named, nothing is decided.
            page.fill("#arg-extra", "{bad")
            page.click("#review")
            expect(page.locator("#error")).to_contain_text(re.compile("extra: is not valid JSON", re.I))
            expect(page.locator("#arg-extra")).to_have_value("{bad")  # what was typed is kept
            # A pattern, a bound, a whole number and a nested pattern, each named.
            page.fill("#arg-extra", '{"po": 8}')
            page.fill("#arg-vendor", "ACME!")
            page.fill("#arg-amount", "9000")
            page.fill("#arg-address-postcode", "12")
            page.click("#review")
            for words in ("vendor: 'ACME!' does not match", "amount: 9000 is greater than the maximum",
                          "postcode: '12' does not match"):
                expect(page.locator("#error")).to_contain_text(re.compile(re.escape(words), re.I))
            page.fill("#arg-installments", "2.5")
            page.fill("#arg-vendor", "globex")
            page.fill("#arg-amount", "120.5")
            page.fill("#arg-address-postcode", "69001")
            page.click("#review")
            expect(page.locator("#error")).to_contain_text("whole number")
            # A valid edit: every kind changed, and the diff shows each change before anything is decided.
            page.fill("#arg-installments", "3")
            page.select_option("#arg-currency", '"USD"')
            page.select_option("#arg-urgent", "true")
            page.fill("#arg-address-city", "Lyon")
            page.fill("#arg-cc", "a@x.test\nb@x.test")
            page.fill("#modify-reason", "new vendor")
            page.click("#review")
            diff = page.locator("#diff")
            expect(diff.locator("tr.change")).to_have_count(9)
            expect(diff.locator('tr[data-name="/amount"] td.before')).to_have_text("250.0")
            expect(diff.locator('tr[data-name="/amount"] td.after')).to_have_text("120.5")
            expect(diff.locator('tr[data-name="/address/city"] td.after')).to_have_text('"Lyon"')
            expect(diff.locator('tr[data-name="/extra/po"] td.after')).to_have_text("8")
            assert desk.undolog.approvals.get(rid).state == "pending"
            page.screenshot(path=str(ARTIFACTS / "dashboard-edit-diff.png"), full_page=True)
            page.click("#modify")
            expect(page.locator("#state")).to_have_text("approved")
            assert not page_errors, page_errors
        finally:
            browser.close()
    rec = desk.undolog.approvals.get(rid)
    assert rec.approved_args == {"vendor": "globex", "amount": 120.5, "installments": 3, "currency": "USD",
                                 "urgent": True, "address": {"city": "Lyon", "postcode": "69001"},
                                 "cc": ["a@x.test", "b@x.test"], "extra": {"po": 8}}
    assert rec.decision_reason == "new vendor"
