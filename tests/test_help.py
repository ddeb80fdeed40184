"""`--help` in sections, as llama.cpp's (issue 47): prompt and sampling first, every option once,
and every option of run / chat / serve / bench in a SECTIONS entry (a new option needs one)."""

from __future__ import annotations

import re
from collections import Counter

import click
import pytest
from click.testing import CliRunner

from specrun.cli.main import COMMAND_SECTIONS, cli
from specrun.cli.runtime.help import OTHER, SECTIONS, SectionedCommand, option_name, section_of

SECTIONED = ("run", "chat", "serve", "bench")
HEADING = re.compile(r"^(\S.*):$", re.MULTILINE)


def help_of(*args: str) -> str:
    r = CliRunner().invoke(cli, [*args, "--help"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def options_of(name: str) -> tuple[list[click.Option], click.Context]:
    cmd = cli.commands[name]
    ctx = click.Context(cmd, info_name=name, parent=click.Context(cli, info_name="specrun", **cli.context_settings))
    return [p for p in cmd.get_params(ctx) if isinstance(p, click.Option)], ctx


def rows_of(text: str) -> list[tuple[str, str]]:
    """(section heading, term) for each row of a help text's sections: a term starts a line after
    two spaces (its wrapped help lines start further in) and ends at two spaces or the line's end."""
    rows, heading = [], None
    for line in text.splitlines():
        if m := HEADING.fullmatch(line):
            heading = m.group(1)
        elif heading and (m := re.match(r"  (\S.*?)(?:  |$)", line)):
            rows.append((heading, m.group(1)))
    return rows


def test_run_help_lists_sections_in_order_prompt_first():
    assert HEADING.findall(help_of("run")) == [
        "Prompt & generation", "Sampling", "Speculative decoding", "Model & context", "Conversation",
        "Output & logging", "llama.cpp compatibility"]
    assert rows_of(help_of("run"))[:2] == [("Prompt & generation", "-p, --prompt TEXT"),
                                           ("Prompt & generation", "-f, --file TEXT")]


def test_serve_help_has_a_server_section_and_no_other():
    headings = HEADING.findall(help_of("serve"))
    assert headings[:2] == ["Prompt & generation", "Sampling"]
    assert "Server" in headings and OTHER not in headings


def test_default_command_help_is_run_help():
    assert help_of("-m", "gemma-3-270m") == help_of("run")


@pytest.mark.parametrize("name", SECTIONED)
def test_every_option_appears_exactly_once_in_its_section(name):
    params, ctx = options_of(name)
    expected = [(section_of(option_name(ctx, p)), p.get_help_record(ctx)[0]) for p in params]
    assert Counter(rows_of(help_of(name))) == Counter(expected)
    assert len(set(expected)) == len(expected)


@pytest.mark.parametrize("name", SECTIONED)
def test_every_option_has_a_section(name):
    params, ctx = options_of(name)
    missing = [p.opts[0] for p in params if not any(option_name(ctx, p) in names for names in SECTIONS.values())]
    assert not missing, f"{name}: give {missing} a section in cli/runtime/help.py SECTIONS"
    assert isinstance(cli.commands[name], SectionedCommand)


def test_sections_name_each_option_once():
    names = Counter(n for names in SECTIONS.values() for n in names)
    assert [n for n, k in names.items() if k > 1] == []


def test_an_option_not_in_the_table_still_shows_under_other():
    @click.command(cls=SectionedCommand)
    @click.option("-p", "--prompt")
    @click.option("--brand-new-flag", is_flag=True, help="not in SECTIONS")
    def cmd(prompt, brand_new_flag):
        pass

    text = CliRunner().invoke(cmd, ["--help"]).stdout
    assert HEADING.findall(text) == ["Prompt & generation", "Output & logging", OTHER]
    assert text.index("--brand-new-flag") > text.index(f"{OTHER}:")


def test_sections_share_one_column():
    text = help_of("run")
    starts = {len(m.group(1)) for m in re.finditer(r"^(  \S.*?\S  +)\S", text, re.MULTILINE)}
    assert starts == {34}


def test_group_help_lists_commands_by_section_one_line_each():
    text = help_of()
    assert HEADING.findall(text) == ["Options", *COMMAND_SECTIONS]
    listed = re.findall(r"^  ([a-z][a-z-]+)  +(\S.*)$", text, re.MULTILINE)
    assert [n for n, _ in listed] == [n for section in COMMAND_SECTIONS.values() for n in section]
    assert sorted(n for n, _ in listed) == sorted(n for n, c in cli.commands.items() if not c.hidden)
    assert all(not line.endswith("...") for _, line in listed)


def test_version_names_the_llama_cpp_build():
    """As `llama-cli --version`: the build's ggml version and commit, its backends and CPU features."""
    import llama_cpp

    r = CliRunner().invoke(cli, ["--version"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert re.fullmatch(r"specrun \d+\.\d+\.\d+\S*", lines[0]), lines
    assert re.fullmatch(rf"llama\.cpp: ggml \d+\.\d+\.\d+ \(\w+(-dirty)?\), llama-cpp-python "
                        rf"{re.escape(llama_cpp.__version__)}", lines[1]), lines
    assert re.fullmatch(r"backends: (\w+, )*CPU(, \w+)*; CPU: (\w+ )*\w+", lines[2]) and len(lines) == 3, lines
