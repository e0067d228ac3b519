"""Tools of a chat request: the checks of ``tools``, ``tool_choice`` and ``parallel_tool_calls``, the
call syntax of the template's model family, and the messages as the chat template takes them.

Families (the syntax the model writes its calls in, chosen from the template's source):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5 / 3, Hermes):
  a template that names ``<tool_call>``.
- ``qwen_xml``: ``<tool_call>\n<function=name>\n<parameter=a>\nvalue\n</parameter>\n</function>``
  ``\n</tool_call>`` (Qwen3.5, Qwen3-Coder): a template that names ``<tool_call>``, ``<function=`` and
  ``<parameter=``.
- ``lfm2``: ``<|tool_call_start|>[name(a=1, b="x"), ...]<|tool_call_end|>`` (Liquid's LFM2): a
  template that names ``<|tool_call_start|>`` or ``List of tools:``.
- ``generic``: a template that names no tools (or the plain template), or one whose call syntax is none
  of the above. The tools are described in a system message, as llama-server's generic format does,
  and the answer is one JSON object: ``{"tool_call": {"name": ..., "arguments": {...}}}`` (or
  ``{"tool_calls": [...]}`` when parallel calls are allowed) or ``{"response": "..."}``. Earlier turns'
  calls and tool results are written in the same JSON (the template is not given ``tools``).

Messages go to the template as transformers' ``apply_chat_template`` takes them: ``tool_calls`` with
``function.arguments`` as a mapping (llama.cpp parses the JSON string too; one that is not a JSON
object is a 400 naming it), ``tool`` messages with ``tool_call_id`` and ``name``, assistant
``reasoning_content``. A template of a known family that does not render ``tool_calls`` itself gets
them written into the message's content in the family's syntax.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from rsmem.errors import InvalidRequestError
from rsmem.server.chat import ChatTemplate
from rsmem.server.schemas import ChatMessage, ChatRequest

Json = dict[str, Any]

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (letters, digits, _ - and .)
PYTHON_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class Family(enum.Enum):
    HERMES = "hermes"
    QWEN_XML = "qwen_xml"
    LFM2 = "lfm2"
    GENERIC = "generic"


def family_of(template: ChatTemplate) -> Family:
    source = template.source or ""
    if not template.knows_tools:
        return Family.GENERIC
    if "<|tool_call_start|>" in source or "List of tools:" in source:
        return Family.LFM2
    if "<tool_call>" in source and "<function=" in source and "<parameter=" in source:
        return Family.QWEN_XML
    if "<tool_call>" in source:
        return Family.HERMES
    return Family.GENERIC


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What a chat request asks of its tools: ``choice`` is ``auto``, ``required`` or ``named``
    (``name`` then names the function); ``functions`` maps each name to its arguments' schema."""

    tools: tuple[Json, ...]  # as the template takes them: {"type": "function", "function": {...}}
    functions: dict[str, Json]
    choice: str
    name: str | None
    parallel: bool
    family: Family

    @property
    def forced(self) -> bool:
        """The answer must be a call (``required`` or a named function): a constraint enforces it."""
        return self.choice != "auto"


def tool_request(body: ChatRequest, template: ChatTemplate) -> ToolRequest | None:
    """The request's tools, checked; None when it offers none or ``tool_choice`` is ``none`` (the model
    is then neither shown the tools nor are its calls parsed). Raises InvalidRequestError naming the
    field: a tool whose parameters are not a JSON schema of an object, two tools of one name, a named
    function that is not a tool, a ``tool_choice`` other than ``none`` without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice", "needs tools: the request offers none")
        return None
    functions: dict[str, Json] = {}
    tools = []
    family = family_of(template)
    for i, tool in enumerate(body.tools):
        f = tool.function
        where = f"tools[{i}].function"
        if not NAME.fullmatch(f.name):
            raise InvalidRequestError(f"{where}.name", "must be 1-64 letters, digits, '_', '-' or '.'")
        if family is Family.LFM2 and not PYTHON_NAME.fullmatch(f.name):
            raise InvalidRequestError(f"{where}.name", "cannot be written in LFM2's Python call syntax")
        if f.name in functions:
            raise InvalidRequestError(f"{where}.name", f"{f.name!r} names two tools")
        parameters = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        check_parameters(parameters, f"{where}.parameters")
        functions[f.name] = parameters
        spec: Json = {"name": f.name}
        if f.description is not None:
            spec["description"] = f.description
        spec["parameters"] = parameters
        tools.append({"type": "function", "function": spec})
    if choice == "none":
        return None
    name: str | None = None
    mode: str
    if choice is None or isinstance(choice, str):
        mode = choice or "auto"
    else:
        mode, name = "named", choice.function.name
        if name not in functions:
            raise InvalidRequestError("tool_choice", f"names {name!r}, which is not one of the tools")
    return ToolRequest(tuple(tools), functions, mode, name, body.parallel_tool_calls, family)


def check_parameters(schema: object, param: str) -> None:
    """A JSON schema (any draft jsonschema knows) that may accept an object: arguments are one."""
    from jsonschema.exceptions import SchemaError  # type: ignore[import-untyped]
    from jsonschema.validators import validator_for  # type: ignore[import-untyped]

    if not isinstance(schema, dict):
        raise InvalidRequestError(param, "must be a JSON schema (an object)")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequestError(param, f"is not a valid JSON schema: {exc.message}") from exc
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise InvalidRequestError(param, f"must describe an object (the arguments), not {kind!r}")


# --------------------------------------------------------------------------------------------------
# Messages for the template
# --------------------------------------------------------------------------------------------------


def template_messages(
    body: ChatRequest, template: ChatTemplate, request: ToolRequest | None
) -> tuple[list[Json], list[Json] | None]:
    """The messages and the ``tools`` argument the template renders (see the module docstring)."""
    family = request.family if request is not None else family_of(template)
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ()) if c.get("id")}
    for m in messages:
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
    if family is Family.GENERIC:
        messages = [_generic_message(m, request) for m in messages]
        if request is not None:
            messages = _with_system(messages, generic_prompt(request))
        return messages, None
    if "tool_calls" not in (template.source or ""):
        for m in messages:
            if m.get("tool_calls"):
                m["content"] = write_calls(family, m["tool_calls"]) + m["content"]
    return messages, list(request.tools) if request is not None else None


def _message(m: ChatMessage, i: int) -> Json:
    out: Json = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            args = call.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as exc:
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise InvalidRequestError(where, f"is not JSON: {exc}") from exc
            if not isinstance(args, dict):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise InvalidRequestError(where, "must be a JSON object")
            entry: Json = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        out["tool_calls"] = calls
    return out


def write_calls(family: Family, calls: list[Json]) -> str:
    """Calls (``{"function": {"name", "arguments": mapping}}``) in the family's own syntax."""
    fns = [c["function"] for c in calls]
    if family is Family.LFM2:
        items = ", ".join(
            f"{f['name']}({', '.join(f'{k}={_python_value(v)}' for k, v in f['arguments'].items())})"
            for f in fns
        )
        return f"<|tool_call_start|>[{items}]<|tool_call_end|>"
    if family is Family.QWEN_XML:
        return "".join(
            f"<tool_call>\n<function={f['name']}>\n"
            + "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in f["arguments"].items())
            + "</function>\n</tool_call>"
            for f in fns
        )
    if family is Family.HERMES:
        return "".join(
            f"<tool_call>\n{json.dumps({'name': f['name'], 'arguments': f['arguments']}, ensure_ascii=False)}"
            "\n</tool_call>"
            for f in fns
        )
    raise ValueError(f"no call syntax for {family}")


def _xml_value(value: object) -> str:
    """A value as Qwen's templates write a parameter: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _python_value(value: object) -> str:
    """A JSON value as a Python literal (what LFM2 writes): True/False/None for JSON's constants."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_python_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_python_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def generic_prompt(request: ToolRequest) -> str:
    """The system text of the generic format: the tools and the JSON answer it asks for."""
    tools = json.dumps([t["function"] for t in request.tools], indent=2, ensure_ascii=False)
    call = '{"name": "<tool name>", "arguments": {<its arguments>}}'
    if request.parallel:
        calls = f'{{"tool_calls": [{call}, ...]}} to call one or more tools'
    else:
        calls = f'{{"tool_call": {call}}} to call a tool'
    answer = "" if request.forced else ', or {"response": "<your answer>"} to answer the user'
    return (
        f"You can call these tools (the JSON schema of each one's arguments is its parameters):\n{tools}\n\n"
        f"Answer with one JSON object and nothing else: {calls}{answer}."
    )


def _generic_message(m: Json, request: ToolRequest | None) -> Json:
    """Calls and tool results as JSON text, for a template that knows neither (as minja polyfills)."""
    if m.get("tool_calls"):
        fns = [dict(c["function"]) for c in m["tool_calls"]]
        parallel = request is None or request.parallel or len(fns) > 1
        answer: Json = {"tool_calls": fns} if parallel else {"tool_call": fns[0]}
        if m["content"]:
            answer["content"] = m["content"]
        return {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)}
    if m["role"] == "tool":
        result: Json = {"content": m["content"]}
        if "name" in m:
            result = {"tool": m["name"]} | result
        if "tool_call_id" in m:
            result["tool_call_id"] = m["tool_call_id"]
        return {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    return {k: v for k, v in m.items() if k in ("role", "content", "reasoning_content")}


def _with_system(messages: list[Json], text: str) -> list[Json]:
    if messages and messages[0]["role"] == "system":
        first = messages[0] | {"content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
