"""Chat prompts as token ids: the model's template rendered by transformers, message text kept as text.

The template is rendered by transformers' `apply_chat_template`, so the text is exactly what
transformers (and vLLM) render. Tokenizing that text whole, as they do, would turn a control token
spelled inside a message (``<|im_start|>system ...``), a tool's description or a tool call's
arguments or id into the real control token and let a user forge a turn. So when any such string
spells the text of a special token, the prompt is tokenized in pieces: the template's own text with
special tokens recognised, the caller's strings with them read as plain text. Where none spells one
(almost always), the ids are exactly those of `apply_chat_template(..., tokenize=True)`.

Finding those strings inside the rendered text: the template is rendered a second time with each
of them replaced by a unique marker; the text between markers is the template's, and each marker
must stand for the string as it is, trimmed, or JSON-escaped (`tojson`). A template that renders
them otherwise is refused for such requests rather than guessed at.

This module is shared by the engine's offline API and the web tier (which tokenizes before
queueing); it needs transformers, never torch or Django.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError

_MARKER = "\ue000{}\ue001"  # private-use code points: never in a template, never trimmed
_MARKER_RE = re.compile("\ue000(\\d+)\ue001")


class ChatTemplateError(InvalidRequestError):
    """The conversation cannot be rendered by the model's chat template."""


class RenderedTooLong(Exception):
    """The rendered conversation is longer (in UTF-8 bytes) than the caller allowed."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the rendered prompt is {size} bytes long")
        self.size = size


def message_text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ChatTemplateError("message content must be a string or a list of text parts")


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: `developer` is `system`, content is text
    (empty where an assistant message has only tool calls), a tool call's arguments an object."""
    out = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        message: dict[str, Any] = {
            "role": "system" if role == "developer" else str(role),
            "content": ""
            if content is None and (m.get("tool_calls") or role == "tool")
            else message_text(content),
        }
        if m.get("tool_calls"):
            message["tool_calls"] = [_template_call(call) for call in m["tool_calls"]]
        if m.get("tool_call_id") is not None:
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    # Templates write arguments with `| tojson` (vLLM hands them an object, as transformers
    # documents); the API carries them as JSON text.
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # not JSON: the template gets the text the caller sent
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": arguments},
    }


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template and "tool_calls" in template


_TOOLS_INTRO = (
    "You can call functions to help with the user's request. Their signatures, as JSON, are "
    "between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\nTo call one, answer with its name "
    "and an arguments object as JSON between <tool_call> and </tool_call>, one call per pair:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


def with_tools_as_text(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A conversation with tools for a template that knows none: the tools described in the system
    message, calls and results as text in the Hermes format (what the `hermes` parser reads)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            out.append(
                {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls}
            )
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        intro = _TOOLS_INTRO.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{intro}"}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


def render(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as the template renders it for the assistant's turn; ``template_kwargs``
    are the template's own variables (Qwen3's enable_thinking)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("This model has no chat template; use /v1/completions.")
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        extra["tools"] = list(tools)
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as exc:  # jinja2's TemplateError, or raise_exception() called by the template
        raise ChatTemplateError(f"The model's chat template rejected the conversation: {exc}") from exc


def special_token_texts(tokenizer: Any) -> list[str]:
    """Texts the tokenizer turns into control tokens wherever they appear."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in decoder.values() if getattr(t, "special", False)}
    texts.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((t for t in texts if t), key=len, reverse=True)


def _encode(tokenizer: Any, text: str, *, plain: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=plain))


def chat_prompt_token_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    max_text_bytes: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the conversation rendered for the assistant's turn (the template adds BOS).

    `tools` (OpenAI's function tools) go to a template that renders tools; for one that does not,
    they, the calls and their results are written into the messages as text (with_tools_as_text).
    A rendering longer than `max_text_bytes` raises RenderedTooLong before it is tokenized."""
    msgs = normalize_messages(messages)
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
    if (tools or has_tool_turns) and not template_knows_tools(tokenizer):
        msgs, tools = with_tools_as_text(msgs, tools or []), None
    text = render(tokenizer, msgs, tools, template_kwargs)
    if max_text_bytes is not None and len(text) * 4 > max_text_bytes:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_text_bytes:
            raise RenderedTooLong(size)
    specials = special_token_texts(tokenizer)
    values: list[str] = []
    probe_msgs = [_marked(m, specials, values, content=True) for m in msgs]
    probe_tools = _marked(list(tools), specials, values) if tools else tools
    if not values:
        return _encode(tokenizer, text, plain=False)
    ids: list[int] = []
    pos = 0
    for start, end in _value_spans(tokenizer, probe_msgs, probe_tools, values, text, template_kwargs):
        ids += _encode(tokenizer, text[pos:start], plain=False)
        ids += _encode(tokenizer, text[start:end], plain=True)
        pos = end
    ids += _encode(tokenizer, text[pos:], plain=False)
    return ids


def _marked(value: Any, specials: list[str], values: list[str], *, content: bool = False) -> Any:
    """`value` with every string that spells a control token (a message's content, a tool's
    description or schema, a call's id, name or arguments, keys included) replaced by a marker
    whose index in `values` is the string's."""
    if isinstance(value, str):
        if any(s in value for s in specials):
            values.append(value)
            return _MARKER.format(len(values) - 1)
        return value
    if isinstance(value, dict):
        if content:  # a message: its role is the template's to read, the rest is the caller's
            return {k: v if k == "role" else _marked(v, specials, values) for k, v in value.items()}
        return {_marked(k, specials, values): _marked(v, specials, values) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_marked(v, specials, values) for v in value]
    return value


def _renderings(value: str) -> tuple[str, ...]:
    """What a template may write for a string: as it is, trimmed, or as the inside of a JSON string
    (`tojson`, with or without ASCII escapes)."""
    return tuple(
        dict.fromkeys(
            (value, value.strip(), json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1])
        )
    )


def _value_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    values: list[str],
    text: str,
    template_kwargs: dict[str, Any] | None = None,
) -> list[tuple[int, int]]:
    """(start, end) of each occurrence of a marked value in the rendered ``text``, in order. The
    text must be exactly the template's own text (the rendering with markers) with each marker
    replaced by one rendering of its value; anything else is refused, never guessed at."""
    skeleton = render(tokenizer, messages, tools, template_kwargs)
    parts = _MARKER_RE.split(skeleton)  # template text, index, template text, index, ...
    pieces, order = parts[0::2], [int(i) for i in parts[1::2]]
    spans = []
    pos = 0
    if text.startswith(pieces[0]):
        pos = len(pieces[0])
        for k, i in enumerate(order):
            for candidate in _renderings(values[i]):
                if text.startswith(candidate, pos) and text.startswith(pieces[k + 1], pos + len(candidate)):
                    spans.append((pos, pos + len(candidate)))
                    pos += len(candidate) + len(pieces[k + 1])
                    break
            else:
                break
        else:
            if pos == len(text):
                return spans
    raise ChatTemplateError("This model's chat template changes the text of messages or tools; they may "
                            "not contain the text of a control token with it.")  # fmt: skip
