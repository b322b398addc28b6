"""The repository holds only the product: every relative markdown link resolves inside it, and no
file names a machine path or a link outside the repository."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = ("http://", "https://", "mailto:")


def tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def broken_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks are not links
    bad = []
    for target in LINK.findall(text):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        resolved = (path.parent / target.split("#", 1)[0]).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            bad.append(target)
    return bad


@pytest.mark.parametrize("path", tracked("*.md"), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(path):
    assert broken_links(path) == []


def test_the_link_check_sees_a_broken_link(tmp_path, monkeypatch):
    page = ROOT / "docs" / "style.md"
    assert broken_links(page) == []
    fake = tmp_path / "page.md"
    fake.write_text("[ok](https://example.com) [gone](missing.md) "
                    "[up](../../../etc/passwd)\n```\n[x](code.md)\n```\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert broken_links(fake) == ["missing.md", "../../../etc/passwd"]


def test_no_machine_paths_or_session_notes():
    # the patterns are split so that this file does not match itself
    pattern = "|".join(["/" + "work/", r"\.\./" + "shared/", "session " + "ends", "final " + "report"])
    found = subprocess.run(["git", "grep", "-nIE", pattern], cwd=ROOT, capture_output=True, text=True)
    assert found.stdout == ""


def test_no_cron_line_of_the_docs_writes_to_a_shared_directory():
    """A cron line of the runbooks once wrote `status --check` to a fixed /tmp/dflash-check.txt, which
    another user of the machine could plant (a symlink) or read. Cron lines write to no /tmp or
    /var/tmp path."""
    lines = [line for path in tracked("*.md")
             for block in re.findall(r"```cron\n(.*?)```", path.read_text(), flags=re.S)
             for line in block.splitlines() if line.strip()]
    assert lines, "the runbooks show cron lines"
    assert not [line for line in lines if re.search(r"(?<![\w.])/(var/)?tmp/", line)], lines
