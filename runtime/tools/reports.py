"""Measurement reports: one Markdown page and its JSON under `reports/`, written by the script that measured.

Every figure the project quotes comes from a report, never from docs/. A report records the command that
produced it, the commit (with `-dirty` when the tree had changes), the machine and the UTC date, then the
script's own Markdown body; the JSON beside it holds the same header and the raw data. Docs link to the
latest report instead of copying its numbers.

    from runtime.tools.reports import write_report
    write_report("kernel_ab", "Kernel A/B: stage split against the monolithic kernel", data, body_markdown)
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

REPORTS_DIR = Path(__file__).resolve().parents[2] / "reports"


def git_commit(root: Path | None = None) -> str:
    """HEAD's short hash, `-dirty` appended when tracked files differ from it; `unknown` outside a checkout."""
    where = str(root or REPORTS_DIR.parent)
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def machine() -> dict[str, object]:
    """What ran it: CPU model, logical cores, memory, OS and Python."""
    cpu_model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {"cpu": cpu_model, "cores": os.cpu_count(), "memory_gib": memory_gib,
            "os": platform.platform(), "python": platform.python_version()}


def header(command: str | None = None) -> dict[str, object]:
    """The header every report carries: command, commit, machine, date (UTC, to the second)."""
    return {"command": command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "commit": git_commit(), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def write_report(name: str, title: str, data: dict, body_markdown: str, command: str | None = None,
                 root: str | os.PathLike[str] | None = None) -> Path:
    """Write `reports/<name>.md` and `reports/<name>.json` (both replaced whole); returns the .md path.

    `command` is how to rerun the measurement (default: this process's argv); `data` must be JSON-serialisable.
    """
    folder = Path(root) if root is not None else REPORTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    head = header(command)
    cpu = head["machine"]
    lines = [f"# {title}", "",
             f"- command: `{head['command']}`",
             f"- commit: {head['commit']}",
             f"- machine: {cpu['cpu']}, {cpu['cores']} cores, {cpu['memory_gib']} GiB, {cpu['os']}, "
             f"Python {cpu['python']}",
             f"- date: {head['date']}",
             f"- data: [{name}.json]({name}.json)", "", body_markdown.rstrip(), ""]
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    for path, text in ((json_path, json.dumps({**head, "data": data}, indent=1, sort_keys=False) + "\n"),
                       (md_path, "\n".join(lines))):
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_text(text)
        partial.replace(path)
    logger.info("report written: %s", md_path)
    return md_path
