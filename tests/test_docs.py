"""The documentation: README.md stays a short page for a user, with the two set-up commands and
relative links that resolve, and the MkDocs site (docs/, mkdocs.yml) builds with --strict, so
every link and anchor in it resolves, with a CLI reference generated from
`minerva.cli.build_parser()` (docs/hooks/cli_reference.py) that lists every command and option."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minerva.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 300
SERVE = "pip install torch==2.13.0 -e . && minerva serve"
TESTS = "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def readme_links() -> list[str]:
    text = FENCE.sub("", README.read_text(encoding="utf-8"))  # code blocks hold no links
    return LINK.findall(text)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_README_LINES}: move the detail into docs/")


def test_readme_keeps_the_two_set_up_commands_and_ci_runs_the_second():
    text = README.read_text(encoding="utf-8")
    assert SERVE in text and TESTS in text
    assert TESTS in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_readme_relative_links_point_at_files_that_exist():
    links = readme_links()
    assert links, "README.md links to no page of docs/"
    missing = []
    for target in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the page itself
        path = ROOT / target.split("#", 1)[0]
        if not path.exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {', '.join(missing)}"


def test_readme_performance_table_is_its_generated_page():
    """The README's table is the one benchmarks/matrix.py wrote for the machine it names, row
    for row: no hand-kept figures."""
    text = README.read_text(encoding="utf-8")
    marker = re.search(r"<!-- matrix-table: (\S+\.md)", text)
    assert marker, "README.md names no generated performance page (<!-- matrix-table: PAGE -->)"
    after = text[marker.end():].split("\n", 1)[1]
    readme_rows = [line for line in after.split("\n\n", 1)[0].splitlines() if line.startswith("|")]
    page_rows = [line for line in (ROOT / marker.group(1)).read_text(encoding="utf-8").splitlines()
                 if line.startswith("|")]
    assert readme_rows and readme_rows == page_rows, f"README.md's table differs from {marker.group(1)}'s"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            pytest.skip(f"the docs site needs mkdocs and mkdocs-material ({exc}): "
                        f"pip install -e '.[docs]' (the [test] extra has them)")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_docs_site_builds_strict(site):
    for page in ("index.html", "cli/index.html", "server/index.html", "performance/index.html"):
        assert (site / page).is_file(), page


def hook():
    """docs/hooks/cli_reference.py, the module MkDocs runs (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_lists_every_command_and_option(site):
    page = (site / "cli" / "index.html").read_text(encoding="utf-8")
    assert "<!-- cli-reference -->" not in page
    commands = list(hook().commands(build_parser()))
    assert len(commands) > 10
    for words, parser, _ in commands:
        assert f'id="{"-".join(words)}"' in page, f"no section for `{' '.join(words)}`"
        for action in parser._actions:
            for option in action.option_strings:
                assert option in page, f"`{' '.join(words)}` option {option} is missing"


def test_performance_page_lists_the_generated_machine_pages(site):
    page = (site / "performance" / "index.html").read_text(encoding="utf-8")
    assert "<!-- machine-pages -->" not in page
    for generated in sorted((ROOT / "docs" / "performance").glob("*.md")):
        if generated.name != "index.md":
            assert f'href="{generated.stem}/"' in page, f"{generated.name} is not linked"
