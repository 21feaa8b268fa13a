"""Tool calls on /v1/chat/completions: how calls appear in a model's output, and how they are found.

Under tool_choice auto the model writes calls in the format it was trained on, chosen by the
config's `tool_call_parser` (auto: from the chat template's text):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a block per call, text around
  them (Hermes 2/3, Qwen 2.5);
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3), after an
  optional `<|python_tag|>` or inside a Markdown code block; several calls joined by `;`.
Under tool_choice required or a named function guided decoding holds the output to plain JSON
instead (`Forced`): a list of `{"name", "arguments"}` calls, or the named function's arguments
alone. The grammar then guarantees the parse whatever format the model was trained on.
Output that does not parse into calls of the request's functions is returned as text; a Hermes
block that is no such call stays in the text beside the calls that are.
"""
from __future__ import annotations

import json
import re
import uuid


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a model can nest brackets past the parser's recursion limit
        return None


def _call(obj, names: list[str]) -> dict | None:
    """{"name", "arguments"} from a decoded call naming one of `names`; models write either key, and
    some write the arguments as a JSON string (OpenAI's own wire form) rather than an object."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _json(args)
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


class Hermes:
    MARKER = "<tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)  # the last block may lack its end tag

    def start(self, text: str) -> int:
        """Where a call may begin in `text` (len(text): nowhere yet); a partial marker at the end is
        held back until the next delta decides it."""
        found = text.find(self.MARKER)
        if found >= 0:
            return found
        partial = next((k for k in range(len(self.MARKER) - 1, 0, -1) if text.endswith(self.MARKER[:k])), 0)
        return len(text) - partial

    def parse(self, text: str, names: list[str]) -> tuple[str, list[dict]] | None:
        """The calls, and the text around them; a block that is no call of `names` (broken JSON, an
        unknown function) stays in the text, so the caller sees what the model wrote."""
        calls = []

        def take(block: re.Match) -> str:
            call = _call(_json(block.group(1)), names)
            if call is None:
                return block.group(0)
            calls.append(call)
            return ""
        rest = self.BLOCK.sub(take, text)
        return (rest, calls) if calls else None

    def render(self, calls: list[dict]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)


class Llama3Json:
    TAG = "<|python_tag|>"  # a special token: usually dropped by detokenization already
    SEPARATOR = re.compile(r"\s*;?\s*")
    FENCE = "```"  # the whole answer may be a Markdown code block, untagged or tagged json

    def start(self, text: str) -> int:
        head = text.lstrip()
        opens = ("{", self.TAG, self.FENCE)
        if head.startswith(self.FENCE) and "\n" in head:  # a code block of another language is no call
            return 0 if head[3:head.index("\n")].strip() in ("", "json") else len(text)
        return 0 if any(o.startswith(head) for o in opens) or head.startswith(opens) else len(text)

    def parse(self, text: str, names: list[str]) -> tuple[str, list[dict]] | None:
        text = text.strip().removeprefix(self.TAG).lstrip()
        if len(text) >= 6 and text.startswith(self.FENCE) and text.endswith(self.FENCE):  # no regex: linear
            text = text[3:-3].removeprefix("json").strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                obj, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            calls.append(_call(obj, names))
            at = self.SEPARATOR.match(text, at).end()
        return ("", calls) if calls and None not in calls else None

    def render(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)


PARSERS = {"hermes": Hermes(), "llama3_json": Llama3Json()}


def pick_parser(setting: str, chat_template: str | None) -> str:
    """The config's tool_call_parser; `auto` reads the chat template. Hermes templates mention
    "parameters" too (in their tool list), so their marker is looked for first; a template that
    knows no tools gets the Hermes format in the prompt `for_template` writes."""
    if setting != "auto":
        return setting
    template = str(chat_template or "")
    if "<tool_call>" in template:
        return "hermes"
    return "llama3_json" if Llama3Json.TAG in template or '"parameters"' in template else "hermes"


class Forced:
    """The JSON that guided decoding holds the output to under tool_choice required or a named function."""

    def __init__(self, name: str | None):
        self.name = name

    def start(self, text: str) -> int:
        return 0

    def parse(self, text: str, names: list[str]) -> tuple[str, list[dict]] | None:
        data = _json(text)
        if self.name is not None:
            calls = [_call({"name": self.name, "arguments": data}, names)]
        else:
            calls = [_call(c, names) for c in data] if isinstance(data, list) else []
        return ("", calls) if calls and None not in calls else None

    @staticmethod
    def schema(functions: dict[str, dict], name: str | None, parallel: bool) -> dict:
        """The named function's arguments, or a list of calls to any of `functions` (name -> parameters)."""
        if name is not None:
            return functions[name]
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in functions.items()]
        return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


class ToolCallStream:
    """One response's tool calls, found while its text streams, per output index (n > 1): text is
    passed on until a call may start, then held and parsed when that output ends. A whole
    (non-streamed) response is one final push."""

    def __init__(self, fmt: Hermes | Llama3Json | Forced, names: list[str], parallel: bool):
        self.fmt, self.names, self.parallel = fmt, names, parallel
        self.text: dict[int, str] = {}
        self.sent: dict[int, int] = {}

    def push(self, index: int, delta: str, final: bool, truncated: bool = False) -> tuple[str, list[dict]]:
        """The content to send now, and once the output ends its calls in OpenAI's shape. An output
        `truncated` (by max_tokens) has no calls: what it holds is text, so its finish_reason stays."""
        text = self.text[index] = self.text.get(index, "") + delta
        sent = self.sent.get(index, 0)
        cut = self.sent[index] = max(sent, self.fmt.start(text))
        content = text[sent:cut]
        found = self.fmt.parse(text[cut:], self.names) if final and not truncated else None
        if found is None:
            return content + (text[cut:] if final else ""), []
        rest, calls = found
        return content + rest, [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in (calls if self.parallel else calls[:1])]  # parallel_tool_calls false: the first call


def for_template(messages: list[dict], tools: list[dict] | None, template: str | None,
                 parser: str) -> tuple[list[dict], list[dict] | None]:
    """Messages and tools as the chat template takes them. A template that knows no tools (the
    embedded SmolLM2's) would drop them and the calls of earlier turns silently: they become text
    instead, in the parser's format, the tools in the system message."""
    template = str(template or "")
    if "tools" in template and "tool_calls" in template:
        return messages, tools
    fmt, out = PARSERS[parser], []
    for m in messages:
        if m.get("tool_calls"):
            text = "\n".join(filter(None, (m["content"], fmt.render([c["function"] for c in m["tool_calls"]]))))
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        out.append(m)
    if tools:
        example = fmt.render([{"name": "<function name>", "arguments": {"<argument>": "<value>"}}])
        prompt = ("You can call these functions (JSON schemas):\n" + "\n".join(json.dumps(t["function"]) for t in tools)
                  + f"\nTo call functions, answer with:\n{example}")
        if out[0]["role"] == "system":
            out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
