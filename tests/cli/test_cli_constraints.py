"""``generate``'s structured-output flags, as llama-cli names them: ``--grammar``, ``--grammar-file``,
``-j/--json-schema``, ``-jf/--json-schema-file``; an unenforceable one names its flag."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from rsmem.cli import main

SCHEMA = {
    "type": "object",
    "properties": {
        "who": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["who", "n"],
    "additionalProperties": False,
}


def test_json_schema_flags(tmp_path, fast_load, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for flags in (["-j", json.dumps(SCHEMA)], ["--json-schema-file", str(path)], ["-jf", str(path)]):
        assert main(["generate", "ROMEO:", "-n", "40", "--seed", "2", *flags]) == 0
        out = capsys.readouterr().out
        assert out.startswith("ROMEO:")
        jsonschema.validate(json.loads(out[len("ROMEO:") :]), SCHEMA)


def test_grammar_flags(tmp_path, fast_load, capsys):
    grammar = 'root ::= ("yes" | "no") ", " [a-z]{1,5} "!"'
    path = tmp_path / "g.gbnf"
    path.write_text(grammar)
    for flags in (["--grammar", grammar], ["--grammar-file", str(path)]):
        assert main(["generate", "KING:", "-n", "20", "--seed", "1", *flags]) == 0
        assert re.fullmatch(r"KING:(yes|no), [a-z]{1,5}!\n?", capsys.readouterr().out)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-j", '{"type": "array", "uniqueItems": true}'], "rsmem: error: --json-schema cannot be enforced"),
        (["-j", "{not json"], "rsmem: error: --json-schema is not valid JSON"),
        (["--grammar", "root ::= nowhere"], "rsmem: error: --grammar does not parse"),
        (
            ["--grammar", 'root ::= "a"', "--stop", "x"],
            "rsmem: error: --stop cannot be combined with a constraint",
        ),
    ],
)
def test_unenforceable_constraints_name_their_flag(fast_load, capsys, flags, message):
    assert main(["generate", "ROMEO:", "-n", "4", *flags]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(message)


def test_two_constraints_are_a_usage_error(no_load, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "ROMEO:", "-j", "{}", "--grammar", 'root ::= "a"'])
    assert info.value.code == 2
    assert "not allowed with" in capsys.readouterr().err
