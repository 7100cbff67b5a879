"""The docs site builds with `mkdocs build --strict` (mkdocs.yml): a broken link or anchor,
or a page under docs/ left out of the nav, fails here and so in CI. The README is not part
of the site, so its links to files are checked here too."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 120.0  # seconds; a build takes about 1 s
LINK = re.compile(r"\]\(([^)\s]+)\)")


def build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # NO_MKDOCS_2_WARNING: Material prints a banner about MkDocs 2 on every build. Never
    # --quiet: it hides the warnings from the counter that --strict aborts on.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("no mkdocs here: bash scripts/bootstrap.sh test installs the docs extra")
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()
    # The README's quick start, cluster recipe and training loop are on the site too, with
    # its links into docs/ pointing at the site's pages (issue 40 item 8).
    started = (tmp_path / "site" / "getting-started" / "index.html").read_text()
    for heading in ("The two commands", "A real cluster in five minutes", "From a training loop"):
        assert heading in started
    assert 'href="docs/' not in started and 'href="../api/"' in started


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check above means something: strict mode is on and a dead link is an error."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    shutil.copy(ROOT / "README.md", project / "README.md")
    shutil.copytree(ROOT / "scripts", project / "scripts")
    with (project / "docs" / "index.md").open("a") as page:
        page.write("\nSee [a page that is not there](nowhere.md).\n")
    result = build(project, tmp_path / "site")
    assert result.returncode != 0
    assert "nowhere.md" in result.stderr


def test_every_file_the_readme_links_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    links = [link for link in LINK.findall(readme) if "://" not in link]
    assert links, "the README links to no page"
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"
