"""Slack's Block Kit from the desk's data: escaped text, a generated form as a modal's inputs and back, an edit's diff.

Pure functions of their arguments (no Slack client, no database): :mod:`undolog_server.slack` posts and handles what
they build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import forms
from .forms.fields import num_text

#: The ``action_id`` of every modal input (its ``block_id`` is the field's name).
VALUE_ACTION = "value"

#: Words that notify a whole channel: :func:`escape` breaks them.
MENTION_WORDS = ("@channel", "@here", "@everyone")


def escape(text: Any) -> str:
    """Text for a Slack ``mrkdwn`` or ``plain_text`` field: ``&``, ``<`` and ``>`` escaped (so ``<!channel>``,
    ``<@U123>`` and links cannot be injected) and ``@channel``-style words broken.

    Example:
        >>> escape("<!channel> pay @here & <https://evil|bank>")
        '&lt;!channel&gt; pay @\\u200bhere &amp; &lt;https://evil|bank&gt;'
    """
    s = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for word in MENTION_WORDS:
        s = s.replace(word, "@\u200b" + word[1:])
    return s


def fold(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out (Slack refuses longer fields)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… (+{len(text) - limit} characters)"


def plain(text: str, limit: int = 150) -> dict[str, Any]:
    """A ``plain_text`` object of ``text``, escaped and folded to Slack's ``limit``."""
    return {"type": "plain_text", "text": fold(escape(text), limit - 20) if len(text) > limit else escape(text),
            "emoji": False}


def arg_leaves(args: Mapping[str, Any], path: tuple[str, ...] = (), depth: int = 0) -> list[tuple[tuple[str, ...], Any]]:
    """A call's arguments as (path, value) pairs, nested mappings opened three levels deep (a message's fields)."""
    out: list[tuple[tuple[str, ...], Any]] = []
    for k, v in args.items():
        p = (*path, str(k))
        if isinstance(v, Mapping) and v and depth < 3:
            out.extend(arg_leaves(v, p, depth + 1))
        else:
            out.append((p, v))
    return out


def view_errors(errs: Mapping[str, str], view: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Errors for a modal's submission; a refusal is shown on the view's first input block."""
    if view is not None:
        blocks = [b.get("block_id") for b in view.get("blocks") or [] if b.get("type") == "input" and b.get("block_id")]
        if blocks:
            errs = {blocks[0]: next(iter(errs.values()))}
        else:
            # A review view has no inputs: replace it with one that says why.
            return {"response_action": "update", "view": {
                "type": "modal", "title": {"type": "plain_text", "text": "Not decided"},
                "close": {"type": "plain_text", "text": "Close"},
                "blocks": [{"type": "section", "block_id": "undolog_notice",
                            "text": {"type": "mrkdwn", "text": escape(next(iter(errs.values())))}}]}}
    return {"response_action": "errors", "errors": {k: fold(v, 140) for k, v in errs.items()}}


def modal_blocks(form: forms.Form) -> list[dict[str, Any]]:
    """A generated form's fields as a Slack modal's input blocks (``block_id``: the field's name).

    Example:
        >>> [b["element"]["type"] for b in modal_blocks(forms.build({"type": "object", "properties": {
        ...     "n": {"type": "integer"}, "c": {"enum": ["a", "b"]}}}, {"n": 1}))]
        ['number_input', 'static_select']
    """
    blocks: list[dict[str, Any]] = []
    for f in form.leaves()[:95]:
        element: dict[str, Any]
        if f.kind in ("enum", "boolean"):
            options = [{"text": {"type": "plain_text", "text": fold(escape(label), 70)}, "value": value[:150]}
                       for value, label in f.options][:100]
            element = {"type": "static_select", "action_id": VALUE_ACTION, "options": options}
            chosen = [o for o in options if o["value"] == f.value]
            if chosen:
                element["initial_option"] = chosen[0]
        elif f.kind in ("integer", "number"):
            element = {"type": "number_input", "action_id": VALUE_ACTION, "is_decimal_allowed": f.kind == "number"}
            if f.value:
                element["initial_value"] = f.value
            if f.minimum is not None:
                element["min_value"] = num_text(f.minimum)
            if f.maximum is not None:
                element["max_value"] = num_text(f.maximum)
        else:
            element = {"type": "plain_text_input", "action_id": VALUE_ACTION, "multiline": f.kind in ("array", "json")}
            if f.value:
                element["initial_value"] = f.value[:3000]
        block: dict[str, Any] = {"type": "input", "block_id": f.name, "label": plain(f.label, 2000),
                                 "element": element, "optional": not f.required or f.kind in ("string", "array")}
        hint = " · ".join(x for x in (f.description, f.hint) if x)
        if hint:
            block["hint"] = plain(hint, 2000)
        blocks.append(block)
    return blocks


def submitted_values(view: Mapping[str, Any]) -> dict[str, str]:
    """A submitted modal's values as ``{field name: text}`` for :func:`undolog_server.forms.parse`."""
    out: dict[str, str] = {}
    values = ((view.get("state") or {}).get("values")) or {}
    for block_id, actions in values.items():
        element = (actions or {}).get(VALUE_ACTION) or {}
        if "selected_option" in element:
            opt = element.get("selected_option") or {}
            out[str(block_id)] = str(opt.get("value") or "")
        else:
            v = element.get("value")
            out[str(block_id)] = "" if v is None else str(v)
    return out


def diff_blocks(changes: Sequence[forms.Change]) -> list[dict[str, Any]]:
    """An edit's diff as modal blocks, shown before the edit is approved."""
    if not changes:
        return [{"type": "section", "block_id": "undolog_diff",
                 "text": {"type": "mrkdwn", "text": "No change: the edit is the proposed arguments."}}]
    lines = []
    for c in changes[:40]:
        name = escape(" › ".join(c.path))
        if c.kind == "added":
            lines.append(f"• *{name}* added: `{escape(fold(c.after_text, 200))}`")
        elif c.kind == "removed":
            lines.append(f"• *{name}* removed (was `{escape(fold(c.before_text, 200))}`)")
        else:
            lines.append(f"• *{name}*: `{escape(fold(c.before_text, 200))}` → `{escape(fold(c.after_text, 200))}`")
    return [{"type": "section", "block_id": "undolog_diff",
             "text": {"type": "mrkdwn", "text": fold("*What the edit changes*\n" + "\n".join(lines), 2900)}}]
