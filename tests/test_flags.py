"""No command of the project takes an abbreviated flag (`--host` is not `--hosts`).

Two checks: every `ArgumentParser(...)` call in the project's code (runtime/, sweep/, scripts/) is
either the project's own parser (runtime.core.errors.ArgumentParser, `allow_abbrev=False` by default)
or passes `allow_abbrev=False` (found by reading the code, so a new script is covered the day it is
added); and each user command's real parser (every `expertsweep` subcommand and its `python -m` /
script form) refuses the unambiguous prefix of each of its long flags.
"""

from __future__ import annotations

import argparse
import ast
import importlib
from pathlib import Path

import pytest

from runtime.core.errors import ArgumentParser, InputError

REPO = Path(__file__).resolve().parent.parent
CODE = sorted(p for d in ("runtime", "sweep", "scripts") for p in (REPO / d).rglob("*.py"))


def _parser_calls(path: Path) -> list[tuple[int, str, bool]]:
    """(line, how it is named, allow_abbrev=False given) of each ArgumentParser(...) call in a file, and
    whether the bare name `ArgumentParser` there is the project's (imported from runtime.core.errors)."""
    tree = ast.parse(path.read_text(), str(path))
    ours = any(isinstance(n, ast.ImportFrom) and n.module == "runtime.core.errors"
               and any(a.name == "ArgumentParser" for a in n.names) for n in ast.walk(tree))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name != "ArgumentParser":
            continue
        off = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                  for k in node.keywords)
        project = isinstance(f, ast.Name) and ours and not any(k.arg == "allow_abbrev" for k in node.keywords)
        out.append((node.lineno, ast.unparse(f), off or project))
    return out


def test_every_parser_in_the_code_refuses_abbreviations():
    calls = {f"{p.relative_to(REPO)}:{line} {name}": ok for p in CODE for line, name, ok in _parser_calls(p)}
    assert len(calls) >= 25, sorted(calls)  # the scan finds the parsers (about 30 today)
    bad = sorted(k for k, ok in calls.items() if not ok)
    assert not bad, f"ArgumentParser without allow_abbrev=False: {bad}"


def test_the_scan_sees_a_parser_that_allows_abbreviations(tmp_path):
    """The check above can fail: a plain argparse parser, or the project's with allow_abbrev=True, is found."""
    f = tmp_path / "x.py"
    f.write_text("import argparse\nfrom runtime.core.errors import ArgumentParser\n"
                 "a = argparse.ArgumentParser()\nb = ArgumentParser(allow_abbrev=True)\n"
                 "c = argparse.ArgumentParser(allow_abbrev=False)\nd = ArgumentParser()\n")
    assert [ok for _, _, ok in _parser_calls(f)] == [False, False, True, True]


def _recorded_parsers(module: str, fn: str, argv: list[str]) -> list[argparse.ArgumentParser]:
    """The parsers a command's entry point builds before it parses `argv` (its parse is stopped there)."""
    seen: list[argparse.ArgumentParser] = []

    class _Parsed(Exception):
        pass

    original = argparse.ArgumentParser.parse_known_args

    def record(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(self)
        raise _Parsed

    argparse.ArgumentParser.parse_known_args = record
    try:
        getattr(importlib.import_module(module), fn)(argv)
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = original
    return seen


# every user command: (module, entry point) as `expertsweep COMMAND` runs it (runtime/cli.py COMMANDS)
def _commands() -> list[tuple[str, str, str]]:
    from runtime import cli

    return [(name, module, fn) for name, (module, fn, *_) in cli.COMMANDS.items()]


@pytest.mark.parametrize("name,module,fn", _commands(), ids=[c[0] for c in _commands()])
def test_each_command_refuses_every_abbreviated_flag(name, module, fn):
    parsers = _recorded_parsers(module, fn, ["--x"])
    assert parsers, f"{name}: no parser was built"
    p = parsers[0]
    assert isinstance(p, ArgumentParser) and p.allow_abbrev is False, name
    for a in p._actions:  # noqa: SLF001 - only what the flag under test needs: no other flag is required
        a.required = False
    for g in p._mutually_exclusive_groups:  # noqa: SLF001
        g.required = False
    longs = [s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"]  # noqa: SLF001
    assert longs, name
    tried = 0
    for flag in longs:
        prefix = flag[:-1]
        if any(other != flag and other.startswith(prefix) for other in longs) or prefix in longs:
            continue  # ambiguous or itself a flag: argparse refuses it anyway, or it is another flag
        value = [] if p._option_string_actions[flag].nargs == 0 else ["1"]  # noqa: SLF001
        _, rest = p.parse_known_args([prefix, *value])
        assert prefix in rest, f"{name}: {prefix} was taken for {flag}"
        tried += 1
    assert tried >= 3, name


def test_the_issue_typo_is_refused():
    """`expertsweep sweep --host rtx4090` (for --hosts) is one line, not a full sweep."""
    from sweep import driver

    with pytest.raises(InputError, match=r"unrecognized arguments: --host rtx4090"):
        driver.build_parser().parse_args(["--config", "smoke", "--host", "rtx4090"])
    from runtime import cli

    with pytest.raises(InputError, match="invalid choice"):
        cli.build_parser().parse_args(["swee"])  # a subcommand is no prefix either
