"""The command line in-process (``main([...])``): where prompts come from, invalid bytes, output paths
checked before any work, errors naming the flag the user typed, and llama.cpp's option conventions."""

from __future__ import annotations

import errno
import re

import pytest

from rsmem.cli import main
from rsmem.cli.run import save_state
from rsmem.cli.sampling import unescape
from rsmem.engine import Session

# ----------------------------------------------------------------------------- invalid input bytes


def test_non_utf8_stdin_is_one_error_line_naming_the_byte(stdin_bytes, no_load, capsys):
    stdin_bytes(b"ROM\xffEO:")
    assert main(["generate", "-n", "3"]) == 1
    assert capsys.readouterr().err == "rsmem: error: stdin: invalid UTF-8 at byte 3 (0xff)\n"


def test_non_utf8_prompt_argument_is_one_error_line(no_load, capsys):
    # a byte that is not UTF-8 in argv reaches Python as a lone surrogate (os.fsdecode)
    assert main(["generate", "ROMEO\udcff:"]) == 1
    assert capsys.readouterr().err == "rsmem: error: the prompt argument: invalid UTF-8 at byte 5 (0xff)\n"
    assert main(["generate", "-p", "\udce9"]) == 1
    assert capsys.readouterr().err == "rsmem: error: -p: invalid UTF-8 at byte 0 (0xe9)\n"


def test_non_utf8_line_in_chat_is_one_error_line(stdin_bytes, fast_load, capsys):
    stdin_bytes(b"ROMEO:\nJUL\xc3IET:\n")
    assert main(["chat", "-n", "2", "--temp", "0"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "rsmem: error: stdin: invalid UTF-8 at byte 10 (0xc3)"


def test_non_utf8_prompt_file_names_the_flag_and_file(tmp_path, no_load, capsys):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"ROMEO:\n\x80")
    assert main(["generate", "-f", str(bad)]) == 1
    assert capsys.readouterr().err == f"rsmem: error: -f {bad}: invalid UTF-8 at byte 7 (0x80)\n"
    assert main(["generate", "--prompts-file", str(bad)]) == 1
    assert f"--prompts-file {bad}: invalid UTF-8 at byte 7" in capsys.readouterr().err


# ------------------------------------------------------------------------------- prompt sources


def test_p_and_f_are_one_whole_prompt_and_prompts_file_is_one_per_line(tmp_path, fast_load, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nJULIET:\n")
    args = ["-n", "4", "--temp", "0"]

    assert main(["generate", "-p", "ROMEO:\\nJULIET:", *args]) == 0  # escapes processed, as llama-cli
    by_p = capsys.readouterr().out
    assert by_p.startswith("ROMEO:\nJULIET:") and "--- prompt" not in by_p

    assert main(["generate", "-f", str(prompts), *args]) == 0  # the whole file, final newline dropped
    assert capsys.readouterr().out == by_p

    assert main(["generate", "--prompts-file", str(prompts), "--parallel", "2", *args]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^--- prompt \d ---$", out, re.M) == ["--- prompt 1 ---", "--- prompt 2 ---"]


@pytest.mark.parametrize(
    "argv",
    [
        ["ROMEO:", "-p", "JULIET:"],
        ["ROMEO:", "-f", "x.txt"],
        ["-f", "x.txt", "--prompts-file", "y.txt"],
        ["-p", "a", "--prompts-file", "x.txt"],
    ],
)
def test_the_prompt_is_given_one_way(argv, no_load, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", *argv])
    assert exited.value.code == 2
    assert "give the prompt one way" in capsys.readouterr().err


def test_stdin_prompt_with_a_seed_is_reproducible(stdin_bytes, fast_load, capsys):
    outs = []
    for _ in range(2):
        stdin_bytes(b"KING:")
        assert main(["generate", "-n", "12", "--seed", "7"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("KING:") and len(outs[0]) > len("KING:\n")


# ---------------------------------------------------------------------------------- output paths


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_save_state_in_a_missing_folder_fails_before_loading(tmp_path, command, no_load, capsys):
    target = tmp_path / "missing" / "s.ggsq"
    argv = [command, "--save-state", str(target)] + (["ROMEO:"] if command == "generate" else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"rsmem: error: --save-state {target}: the folder '{target.parent}' does not exist\n"
    assert not target.parent.exists()  # nothing created


def test_save_state_under_a_file_or_onto_a_folder_fails_before_loading(tmp_path, no_load, capsys):
    (tmp_path / "file").write_text("")
    assert main(["generate", "hi", "--save-state", str(tmp_path / "file" / "s.ggsq")]) == 1
    assert "is not a folder" in capsys.readouterr().err
    assert main(["generate", "hi", "--save-state", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"rsmem: error: --save-state {tmp_path}: is a folder, not a file\n"


def test_convert_checks_its_output_folder_before_converting(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # never read: the output check comes first
    out = tmp_path / "missing" / "m.gguf"
    assert main(["convert", str(tmp_path), str(out)]) == 1
    assert capsys.readouterr().err == (
        f"rsmem: error: the output {out}: the folder '{out.parent}' does not exist\n"
    )


def test_save_error_names_the_path_typed_not_the_temporary_file():
    class Engine:
        def save_session(self, session, path):
            raise PermissionError(errno.EACCES, "Permission denied", "/abs/out/.s.ggsq.tmp1234")

    with pytest.raises(Exception, match=r"^--save-state out/s.ggsq: Permission denied$"):
        save_state(Engine(), Session(0), "out/s.ggsq")


def test_missing_load_state_fails_before_loading(no_load, capsys):
    assert main(["generate", "hi", "--load-state", "/no/such/state.ggsq"]) == 1
    assert capsys.readouterr().err == (
        "rsmem: error: --load-state /no/such/state.ggsq: No such file or directory\n"
    )


# ------------------------------------------------------------------------------- flags in errors


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--temp", "-1"),
        ("--top-p", "0"),
        ("--min-p", "2"),
        ("--repeat-penalty", "1e-40"),
        ("--repeat-last-n", "-2"),
        ("--presence-penalty", "1e9"),
        ("--top-k", "-1"),
    ],
)
def test_sampling_errors_name_the_flag_before_loading(flag, value, no_load, capsys):
    assert main(["generate", "hi", flag, value]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rsmem: error: {flag} must be") and err.count("\n") == 1
    assert "SamplingParams" not in err and "_" not in err.split(" must ")[0]


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["generate", "hi", "-m", "/no/such/model.gguf"], 1, "rsmem: error: model not found"),
        (["generate", "hi", "--parallel", "0"], 2, "--parallel must be at least 1"),
        (["info", "/no/such/model.gguf"], 1, "rsmem: error: model not found"),
        (["convert", "/no/such/dir", "out.gguf"], 1, "not a Hugging Face model folder"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_bad_options_are_one_clear_line(argv, code, message, capsys):
    try:
        got = main(argv)
    except SystemExit as exited:  # usage errors: argparse prints usage and the error, exit 2
        got = exited.code
    assert got == code
    err = capsys.readouterr().err
    assert message in err and err.strip().splitlines()[-1].startswith("rsmem")


@pytest.mark.parametrize("n", ["0", "-2"])
def test_n_below_one_other_than_minus_one_is_a_usage_error(n, no_load, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "hi", "-n", n])
    assert exited.value.code == 2
    assert f"-n must be at least 1, or -1 for no limit, got {n}" in capsys.readouterr().err


# ------------------------------------------------------------------- llama.cpp's conventions


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("\\n", "\n"),
        ("a\\tb", "a\tb"),
        ("\\\\n", "\\n"),
        ('say \\"hi\\"', 'say "hi"'),
        ("\\'", "'"),
        ("\\x41\\r", "A\r"),
        ("\\q stays", "\\q stays"),
        ("trailing\\", "trailing\\"),
    ],
)
def test_unescape_as_llama_cpp(typed, meant):
    assert unescape(typed) == meant


def test_stop_understands_escapes(fast_load, capsys):
    argv = ["generate", "ROMEO: I", "-n", "60", "--seed", "2", "--temp", "0.8"]
    assert main([*argv, "--no-escape", "--stop", "\\n"]) == 0
    literal = capsys.readouterr().out
    assert literal.count("\n") > 2  # a backslash and an n never appear: the lines go on
    assert main([*argv, "--stop", "\\n"]) == 0
    stopped = capsys.readouterr().out
    assert stopped.endswith("\n") and stopped.count("\n") == 1  # cut at the first newline
    assert literal.startswith(stopped[:-1] + "\n")  # the same text, up to the stop


def test_n_minus_one_generates_until_a_stop(fast_load, capsys):
    # the stop string ends it: with no limit that is the only way it can finish (or EOS)
    assert main(["generate", "ROMEO:", "-n", "-1", "--stop", "e", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "e" not in captured.out[len("ROMEO:") :]
    generated = int(re.search(r"(\d+) generated", captured.err).group(1))
    assert generated >= 1


def test_seed_minus_one_prints_a_seed_that_reproduces_the_text(fast_load, capsys):
    assert main(["generate", "ROMEO:", "-n", "16", "--seed", "-1"]) == 0
    first = capsys.readouterr()
    seeds = re.findall(r"^\[seed: (\d+)\]$", first.err, re.M)
    assert len(seeds) == 1
    assert main(["generate", "ROMEO:", "-n", "16", "--seed", seeds[0]]) == 0
    again = capsys.readouterr()
    assert again.out == first.out and "[seed:" not in again.err


def test_a_state_file_that_does_not_load_names_the_flag_and_file(fast_load, tmp_path, capsys):
    """Review finding: a corrupt --load-state named neither the flag nor the file."""
    path = tmp_path / "s.ggsq"
    assert main(["generate", "ROMEO:", "-n", "2", "--seed", "1", "--save-state", str(path)]) == 0
    data = bytearray(path.read_bytes())
    data[-64:] = b"\xff" * 64  # NaN rows at the end of the last layer's state
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["generate", " more", "--load-state", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rsmem: error: --load-state {path}: ") and "non-finite" in err
    assert err.count("\n") == 1


def test_prompts_file_gives_prompt_k_the_seed_plus_k(tmp_path, fast_load, capsys):
    """The same prompt twice with --seed S: the two samples differ (seeds S and S + 1), and the second
    equals a lone run with --seed S + 1."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nROMEO:\n")
    args = ["-n", "24", "--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0"]
    assert main(["generate", "--prompts-file", str(prompts), "--parallel", "2", "--seed", "7", *args]) == 0
    texts = re.split(r"^--- prompt \d ---\n", capsys.readouterr().out, flags=re.M)[1:]
    assert texts[0] != texts[1]
    assert main(["generate", "-p", "ROMEO:", "--seed", "8", *args]) == 0
    assert capsys.readouterr().out.rstrip("\n") == texts[1].rstrip("\n")
