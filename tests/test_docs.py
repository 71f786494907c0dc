"""The documentation site builds, strictly: every page in the nav, every link and anchor resolves,
every API page's object imports (mkdocstrings)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "policies" / "bct" / "index.html").is_file()
    assert "infinikv.core.Batch" in (tmp_path / "site" / "reference" / "index.html").read_text()


def test_the_readme_links_only_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert targets and all((ROOT / t).is_file() for t in targets), [t for t in targets if not (ROOT / t).is_file()]
    assert len(readme.splitlines()) <= 200
