"""Tools and tool messages through the chat template: the prompt transformers' ``apply_chat_template``
renders for the same messages and tools, the family each template gets, and the generic format for
templates that know no tools."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from rsmem.errors import InvalidRequestError
from rsmem.server.chat import ChatTemplate
from rsmem.server.schemas import ChatRequest
from rsmem.server.tools import Family, family_of, template_messages, tool_request

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "weather", "description": "Forecast", "parameters": PARAMS}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20 °C"},
]

# Qwen 2.5's tool part, cut down: the tools as JSON lines, calls with arguments as a mapping
QWEN = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}
# Tools
<tools>{%- for tool in tools %}
{{ tool | tojson }}{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not tools) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == "assistant" %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# LFM2's template (as Liquid ships it): tools listed in the system turn; it does not render tool_calls
LFM2 = """{{- bos_token -}}
{%- set ns = namespace(system_prompt="") -%}
{%- if messages[0]["role"] == "system" -%}
{%- set ns.system_prompt = messages[0]["content"] -%}
{%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
{%- set ns.system_prompt = ns.system_prompt + ("\\n" if ns.system_prompt else "") -%}
{%- set ns.system_prompt = ns.system_prompt + "List of tools: <|tool_list_start|>[" -%}
{%- for tool in tools -%}
{%- if tool is not string -%}{%- set tool = tool | tojson -%}{%- endif -%}
{%- set ns.system_prompt = ns.system_prompt + tool -%}
{%- if not loop.last -%}{%- set ns.system_prompt = ns.system_prompt + ", " -%}{%- endif -%}
{%- endfor -%}
{%- set ns.system_prompt = ns.system_prompt + "]<|tool_list_end|>" -%}
{%- endif -%}
{%- if ns.system_prompt -%}{{- "<|im_start|>system\\n" + ns.system_prompt + "<|im_end|>\\n" -}}{%- endif -%}
{%- for message in messages -%}
{{- "<|im_start|>" + message["role"] + "\\n" -}}
{%- set content = message["content"] -%}
{%- if message["role"] == "tool" -%}
{%- set content = "<|tool_response_start|>" + content + "<|tool_response_end|>" -%}
{%- endif -%}
{{- content + "<|im_end|>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|im_start|>assistant\\n" -}}{%- endif -%}"""

PLAIN_JINJA = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def prepared(template: ChatTemplate, **body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    request = ChatRequest.model_validate({"messages": MESSAGES, "tools": [TOOL]} | body)
    return template_messages(request, template, tool_request(request, template))


def transformers_prompt(
    source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    return render_jinja_template(
        [messages], tools=tools, chat_template=source, add_generation_prompt=True, bos_token="<s>"
    )[0][0]


# Qwen3.5's call rendering (its XML form), cut down
QWEN_XML = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}{% set tool_call = tool_call.function %}
<tool_call>
<function={{ tool_call.name }}>
{% for args_name, args_value in tool_call.arguments|items %}<parameter={{ args_name }}>
{{ args_value | tojson if args_value is mapping else args_value | string }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if tools %}<tools>{{ tools | length }}</tools>{% endif %}"""


def test_qwen_xml_template_gets_arguments_as_a_mapping():
    template = ChatTemplate(QWEN_XML)
    assert family_of(template) is Family.QWEN_XML
    messages, tools = prepared(template)
    assert tools == [TOOL]
    prompt = template.render(messages, tools=tools)
    assert prompt == transformers_prompt(QWEN_XML, messages, tools)
    assert "<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>" in prompt


def test_families():
    assert family_of(ChatTemplate(QWEN)) is Family.HERMES
    assert family_of(ChatTemplate(LFM2)) is Family.LFM2
    assert family_of(ChatTemplate(PLAIN_JINJA)) is Family.GENERIC
    assert family_of(ChatTemplate()) is Family.GENERIC


def test_hermes_template_renders_as_transformers_does():
    template = ChatTemplate(QWEN, bos_token="<s>")
    messages, tools = prepared(template)
    assert tools == [TOOL]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # a mapping, as HF's
    prompt = template.render(messages, tools=tools)
    assert prompt == transformers_prompt(QWEN, messages, tools)
    assert '{"name": "weather", "arguments": {"city": "Oslo"}}' in prompt
    assert json.dumps(TOOL, ensure_ascii=False) in prompt  # tojson: no HTML escaping, as transformers
    assert "<tool_response>\nsunny, 20 °C\n</tool_response>" in prompt


def test_lfm2_template_gets_the_calls_written_in_its_syntax():
    template = ChatTemplate(LFM2, bos_token="<s>")
    messages, tools = prepared(template)
    prompt = template.render(messages, tools=tools)
    assert prompt == transformers_prompt(LFM2, messages, tools)
    assert "List of tools: <|tool_list_start|>[" in prompt
    assert (
        '<|im_start|>assistant\n<|tool_call_start|>[weather(city="Oslo")]<|tool_call_end|><|im_end|>'
        in prompt
    )
    assert "<|tool_response_start|>sunny, 20 °C<|tool_response_end|>" in prompt


@pytest.mark.parametrize("template", [ChatTemplate(), ChatTemplate(PLAIN_JINJA)])
def test_templates_that_know_no_tools_get_the_generic_format(template: ChatTemplate):
    messages, tools = prepared(template)
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and '"name": "weather"' in system
    assert '{"tool_calls": [' in system and '{"response": ' in system
    assert json.loads(messages[2]["content"]) == {
        "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]
    }
    assert messages[3]["role"] == "user"
    result = {"tool": "weather", "content": "sunny, 20 °C", "tool_call_id": "call_1"}
    assert json.loads(messages[3]["content"]) == {"tool_response": result}
    template.render(messages)
    forced, _ = prepared(template, tool_choice="required", parallel_tool_calls=False)
    assert '{"tool_call": {' in forced[0]["content"] and '"response"' not in forced[0]["content"]


def test_tool_choice_none_shows_no_tools_but_renders_the_conversation():
    template = ChatTemplate(QWEN)
    messages, tools = prepared(template, tool_choice="none")
    assert tools is None
    assert "<tool_call>" in template.render(messages, tools=tools)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "auto", "tools": []}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, None),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"minLength": "x"}}}]},
            None,
        ),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str | None):
    with pytest.raises(InvalidRequestError) as info:
        prepared(ChatTemplate(), **body)
    assert info.value.param == (param or "tools[0].function.parameters")


def test_lfm2_refuses_names_it_cannot_write():
    tool = {"type": "function", "function": {"name": "get-weather"}}
    with pytest.raises(InvalidRequestError) as info:
        prepared(ChatTemplate(LFM2), tools=[tool])
    assert info.value.param == "tools[0].function.name"
