"""Chat prompts: the plain template, and a model's own Jinja template read from GGUF or HF files."""

from __future__ import annotations

import json

import gguf
import numpy as np

from rsmem.server.chat import PLAIN_STOP, ChatTemplate, load_chat_template

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Well met."},
    {"role": "user", "content": "Farewell"},
]
JINJA = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_plain_template():
    t = ChatTemplate()
    assert t.render(MESSAGES) == "Be brief.\n\nUser: Hello\nAssistant: Well met.\nUser: Farewell\nAssistant:"
    assert t.stop == PLAIN_STOP


def test_jinja_template_from_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, "mamba")
    w.add_chat_template(JINJA)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    source = load_chat_template(path)
    assert source == JINJA
    t = ChatTemplate(source, eos_token="</s>")
    assert t.render(MESSAGES[1:2]) == "<|user|>Hello</s><|assistant|>"
    assert t.stop == ()


def test_template_from_hf_folder(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": JINJA}))
    assert load_chat_template(tmp_path) == JINJA
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_chat_template(tmp_path) is None
