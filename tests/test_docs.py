"""The front door holds: docs/options.md is the click help as it is now, no tracked file points outside the
repository, and every relative link in README.md and docs/ reaches a file."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()


def relative_links(page: Path) -> list[str]:
    """Link targets of a markdown page that are paths in the repository (not URLs, not anchors on the page)."""
    targets = [m.group(1).split("#")[0] for m in LINK.finditer(page.read_text(encoding="utf-8"))]
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def test_options_page_is_the_current_help():
    written = subprocess.run([sys.executable, "scripts/options_doc.py"], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=120).stdout
    page = (REPO / "docs/options.md").read_text(encoding="utf-8")
    assert page == written, "docs/options.md is stale: run `python scripts/options_doc.py > docs/options.md`"


def test_no_tracked_file_refers_to_the_shared_folder():
    marker = "../" + "shared"  # spelled in two parts so this file does not match itself
    hits = [name for name in tracked_files()
            if (REPO / name).is_file() and marker in (REPO / name).read_text(encoding="utf-8", errors="replace")]
    assert hits == [], f"files refer to {marker}, outside the repository: {hits}"


def test_relative_links_reach_files():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(REPO)}: {target}" for page in pages for target in relative_links(page)
              if not (page.parent / target).exists()]
    assert broken == [], f"links to missing files: {broken}"


def test_link_check_sees_a_broken_link(tmp_path):
    # the check above is not vacuous: a page's link to a missing file is found, a URL and an anchor are not
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md#x) [b](https://example.com/x.md) [c](#here) [d](page.md)\n", encoding="utf-8")
    assert relative_links(page) == ["missing.md", "page.md"]
