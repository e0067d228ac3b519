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


def test_plain_template_keeps_the_space_an_answer_was_generated_with():
    """The model writes its answer after "Assistant:", so the answer a client gets starts with a space;
    sent back verbatim, it renders the same text the model generated (one space), not two."""
    t = ChatTemplate()
    asked = [{"role": "user", "content": "Hello"}]
    generated = " Well met."
    prompt = t.render(asked)
    history = t.render([*asked, {"role": "assistant", "content": generated}], add_generation_prompt=False)
    assert history == prompt + generated + "\n"
    bare = t.render([*asked, {"role": "assistant", "content": "Well met."}], add_generation_prompt=False)
    assert bare == history


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


def encoded_and_compared(tok, prompt: str, prefixes: list[str]) -> list[int]:
    """The plain definition: each prefix encoded alone, compared token by token with the prompt's."""
    tokens, out = tok.encode(prompt), []
    for text in prefixes:
        part, n = tok.encode(text), 0
        while n < min(len(part), len(tokens)) and part[n] == tokens[n]:
            n += 1
        out.append(n)
    return out


def test_message_boundaries_from_one_encoding_match_encoding_every_prefix(shared_llm):
    from types import SimpleNamespace

    from rsmem.server.routes_openai import message_boundaries

    tok = shared_llm.tokenizer
    state = SimpleNamespace(tokenizer=tok)
    messages = [{"role": "system", "content": "Thou art a player; speak in verse, ça va, 日本語. " * 5}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Who art thou, {turn}?  Nay—whence?"})
        for template in (ChatTemplate(), ChatTemplate(JINJA, eos_token="</s>")):
            prompt, prefixes = template.render(messages), template.message_prefixes(messages)
            tokens, boundaries = message_boundaries(state, prompt, prefixes)
            assert tokens == tok.encode(prompt)
            assert boundaries == encoded_and_compared(tok, prompt, prefixes)
            assert boundaries == sorted(boundaries) and 0 < boundaries[-1] < len(tokens)
        messages.append({"role": "assistant", "content": "A poor player, that struts and frets"})
    # a prefix that is not the prompt's start is encoded and compared
    tokens, boundaries = message_boundaries(state, "User: Hello there\n", ["User: Hello", "Assistant: x"])
    assert boundaries == encoded_and_compared(tok, "User: Hello there\n", ["User: Hello", "Assistant: x"])
