"""MkDocs hook: pages filled in from the code at build time, so they cannot drift from it.

- `<!-- cli-reference -->` becomes the reference of the `minerva` command: every subcommand's
  usage and options, read from `minerva.cli.build_parser()` (what `--help` prints).
- `<!-- machine-pages -->` becomes a list of the per-machine performance pages that
  `benchmarks/matrix.py` wrote under `docs/performance/`.

Enabled by `hooks:` in mkdocs.yml; MkDocs calls `on_page_markdown` for every page.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI_MARKER = "<!-- cli-reference -->"
MACHINES_MARKER = "<!-- machine-pages -->"
WIDTH = 100  # columns of the usage blocks, whatever the terminal building the site


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if MACHINES_MARKER in markdown:
        markdown = markdown.replace(MACHINES_MARKER, machine_pages(Path(page.file.abs_src_path).parent))
    return markdown


# ------------------------------------------------------------------ the CLI


def build_parser() -> argparse.ArgumentParser:
    """This checkout's parser (not that of another installed copy of minerva)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from minerva.cli import build_parser as build

    return build()


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ("minerva",), summary: str | None = None):
    """(words, parser, one-line help) for the command and every subcommand, depth first, in the
    order the parser defines them."""
    yield words, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, (*words, name), helps.get(name))


def subcommand_names(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Every command line the reference documents, e.g. 'minerva bench latency' (for tests)."""
    return [" ".join(words) for words, _, _ in commands(parser or build_parser())]


def cell(text: str) -> str:
    """Text for a Markdown table cell: one line, no raw HTML, no column breaks."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def sentence(text: str) -> str:
    text = cell(text)
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def usage(parser: argparse.ArgumentParser) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def option_table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    rows = ["| argument | what it does |", "| --- | --- |"]
    for action in actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        if action.option_strings:
            metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
            name = ", ".join(f"`{o}{metavar}`" for o in action.option_strings)
        else:
            name = f"`{formatter._metavar_formatter(action, action.dest)(1)[0]}`"
        text = formatter._expand_help(action) if action.help else ""
        if not text and action.default not in (None, False, [], argparse.SUPPRESS):
            text = f"default: {action.default}"
        rows.append(f"| {name} | {cell(text)} |")
    return rows if len(rows) > 2 else []


def section(words: tuple[str, ...], parser: argparse.ArgumentParser, summary: str | None) -> list[str]:
    level = "#" * min(len(words) + 1, 4)
    lines = [f"{level} {' '.join(words)}", ""]
    if summary:
        lines += [sentence(summary), ""]
    if parser.description:
        lines += [cell(parser.description), ""]
    lines += ["```text", usage(parser), "```", ""]
    for group in parser._action_groups:
        table = option_table(parser, group._group_actions)
        if not table:
            continue
        title = group.title or "options"
        lines += [f"**{cell(title[:1].upper() + title[1:])}**", "", *table, ""]
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subs:
        helps = {a.dest: a.help for a in action._choices_actions}
        lines += ["| subcommand | what it does |", "| --- | --- |"]
        for name in action.choices:
            anchor = "-".join((*words, name))
            lines.append(f"| [`{name}`](#{anchor}) | {cell(helps.get(name) or '')} |")
        lines.append("")
    return lines


def cli_reference() -> str:
    lines: list[str] = []
    for words, parser, summary in commands(build_parser()):
        lines += section(words, parser, summary)
    return "\n".join(lines)


# ------------------------------------------------------------------ performance pages


def machine_pages(folder: Path) -> str:
    """A bulleted link to each generated page in `folder` (every .md but index.md), by its title."""
    pages = sorted(p for p in folder.glob("*.md") if p.name != "index.md")
    if not pages:
        return ("No per-machine page has been generated in this checkout yet: "
                "`python benchmarks/matrix.py` writes one for the machine it runs on.")
    items = []
    for p in pages:
        title = next((line[2:].strip() for line in p.read_text(encoding="utf-8").splitlines()
                      if line.startswith("# ")), p.stem)
        items.append(f"- [{cell(title)}]({p.name})")
    return "\n".join(items)
