"""Every `agentaccel ...` command docs/BENCHMARKS.md shows its reader parses with today's command
line, so that a renamed flag or method breaks the build and not a reader's copy-paste. Nothing is
run: each command is resolved to its subcommand, every flag must be one the subcommand declares,
the command line's own parser reads the whole line as the shell hands it over (types, values),
and the methods (and `bench vllm`'s workloads) it names must be ones the command knows. The lab
notebook (docs/lab/) is a record of what was run then, and is not checked."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest
import typer
import typer.main
from doc_commands import fenced_blocks, shell_commands

from agentaccel.bench.vllm.servers import known_method
from agentaccel.bench.vllm.sources import WORKLOADS
from agentaccel.cli.main import app
from agentaccel.engine.cost import parse
from agentaccel.simulation.methods import build

PAGE = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def page_commands(text: str) -> list[str]:
    """The page's agentaccel commands: its bash blocks' commands (after any VAR=value, between
    `&&`, `;` and `|`, before a redirection) and its inline code spans that start with `agentaccel `."""
    found = []
    for block in fenced_blocks(text, "bash"):
        for line in shell_commands(block):
            for part in re.split(r"\s*(?:&&|;|\|)\s*", line):
                words = re.split(r"\s+\d?(?:>>|>|<)", part)[0].split()  # a redirection is the shell's
                while words and ENV.match(words[0]):
                    words.pop(0)
                if words and words[0] == "agentaccel":
                    found.append(" ".join(words))
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found += [span for span in re.findall(r"`(agentaccel [^`]+)`", outside)]
    return list(dict.fromkeys(found))


def vllm_methods(names: list[str]) -> list[str]:
    return [n for n in names if not known_method(n)]


def vllm_workloads(names: list[str]) -> list[str]:
    return [n for n in names if n not in WORKLOADS]


def simulated_methods(names: list[str]) -> list[str]:
    """The names the simulators' one registry does not know (simulation/methods.py checks every
    name before it builds any; a stand-in drafter then cannot build the model methods, and need not)."""
    try:
        build(names, parse("llama-3.1-8b@h100", learned={}), drafter=object())
    except ValueError as e:
        if str(e).startswith("unknown method(s) "):  # "unknown method(s) a, b; known: ..."
            return str(e).split(";")[0].removeprefix("unknown method(s) ").split(", ")
    except Exception:  # the names passed; building them with a stand-in is not the question
        pass
    return []


METHOD_OPTIONS = {("bench", "vllm", "--methods"): vllm_methods,
                  ("bench", "vllm", "--workloads"): vllm_workloads,
                  ("bench", "server", "--methods"): simulated_methods,
                  ("bench", "replay", "--speculators"): simulated_methods}


@functools.cache
def cli():
    return typer.main.get_command(app)


def check(command: str) -> list[str]:
    """What is wrong with `command` against today's CLI (empty: it parses)."""
    words = shlex.split(command)[1:]
    node = cli()
    path: list[str] = []
    while hasattr(node, "commands") and words and not words[0].startswith("-"):
        if words[0] not in node.commands:
            return [f"no command `agentaccel {' '.join(path + words[:1])}`"]
        path.append(words.pop(0))
        node = node.commands[path[-1]]
    if hasattr(node, "commands"):
        return [f"`agentaccel {' '.join(path)}` needs a subcommand"]
    if "--" in words:  # what follows `--` goes to every `vllm serve` (bench vllm), not to us
        words = words[:words.index("--")]
    declared = {name for p in node.params for name in (*p.opts, *p.secondary_opts)}
    problems = [f"{' '.join(path)}: no option {w.split('=')[0]}" for w in words
                if w.startswith("-") and w.split("=")[0] not in declared]
    try:
        node.make_context(" ".join(path), list(words))
    except typer.TyperException as e:  # the parser's own usage errors (typer's click)
        problems.append(f"{' '.join(path)}: {e.format_message()}")
    for (*where, option), unknown in METHOD_OPTIONS.items():
        if path == where and option in words:
            names = [n for n in words[words.index(option) + 1].split(",") if n]
            problems += [f"{' '.join(path)} {option}: no {n}" for n in unknown(names)]
    return problems


def test_the_page_quotes_the_commands_of_its_sections():
    commands = page_commands(PAGE.read_text())
    subcommands = {tuple(shlex.split(c)[1:3]) for c in commands}
    # the roads the headline table compares must each show how to run them again
    assert {("bench", "vllm"), ("bench", "server"), ("bench", "replay"), ("bench", "e2e"),
            ("bench", "proxy"), ("bench", "engine")} <= subcommands, sorted(subcommands)


@pytest.mark.parametrize("command", page_commands(PAGE.read_text()))
def test_a_command_on_the_benchmarks_page_parses_today(command):
    assert check(command) == [], command


def test_a_renamed_flag_or_method_is_caught():
    """The check itself: a flag, a subcommand or a method that does not exist is named."""
    assert check("agentaccel bench vllm --quick --concurrency 1,8,16 -- --enforce-eager") == []
    assert check("agentaccel bench vllm --quik") == ["bench vllm: no option --quik"]
    assert check("agentaccel bench vllm --methods none,sufix") == ["bench vllm --methods: no sufix"]
    assert check("agentaccel bench vllm --workloads agent,sq") == ["bench vllm --workloads: no sq"]
    assert check("agentaccel bench server --concurrency 1,16 --methods none,agentaccel-x,oracle") == \
        ["bench server --methods: no agentaccel-x"]
    assert check("agentaccel bench replay --speculators none,agentaccel,orakel") == \
        ["bench replay --speculators: no orakel"]
    assert check("agentaccel bench warp") == ["no command `agentaccel bench warp`"]
    assert check("agentaccel bench server --concurrency") != []  # an option without its value


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_pages_links_lead_somewhere():
    """The headline table's cells link to sections, the sections to figures and other pages."""
    text = PAGE.read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert [t for t in targets if t.startswith("#") and t[1:] not in anchors] == []
    files = [t.split("#")[0] for t in targets if not t.startswith(("#", "http"))]
    assert [f for f in files if not (PAGE.parent / f).exists()] == []
    scripts = set(re.findall(r"\bscripts/[\w/]+\.(?:py|sh)", text))  # the scripts it tells a reader to run
    assert [s for s in scripts if not (PAGE.parents[1] / s).exists()] == []
