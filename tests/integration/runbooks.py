"""A runbook page's fix commands, read from the page and run as written against the embedded host.

`fix_blocks(page)`: the ```sh blocks of the page's `## Fix` section, each a list of command lines
(comments dropped, as the shell drops them). `Runbook.run(line)` runs one line the way on-call
would paste it: `invoke ...` with the sandbox inventory, `ssh root@HOST pct ...` as the embedded
host's own pct (the host is this machine), the page's placeholders (NAME, OLD_RUN, ...) replaced by
the test's values. A line it cannot run fails the test: the page and the test cannot drift apart.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
FENCE = re.compile(r"^ *```sh\n(.*?)^ *```", re.M | re.S)


def section(page: str, title: str = "Fix") -> str:
    text = (RUNBOOKS / page).read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"{page} has no '## {title}' section"
    return found.group(1)


def fix_blocks(page: str, title: str = "Fix") -> list[list[str]]:
    """The command lines of each ```sh block of the page's section, comments dropped."""
    return [[shlex.join(argv) for argv in (shlex.split(line, comments=True) for line in block.splitlines())
             if argv]
            for block in FENCE.findall(section(page, title))]


class Runbook:
    def __init__(self, deployed, page: str, inventory: str | None = None, **values: str):
        self.deployed, self.page, self.values = deployed, page, values
        self.inventory = inventory or deployed.inventory
        self.ran: list[tuple[str, subprocess.CompletedProcess]] = []

    def argv(self, line: str) -> list[str]:
        def fill(word: str) -> str:
            for key, value in self.values.items():  # NAME, not the NAME in OLD_NAME; SHA256:... as it is
                word = re.sub(rf"\b{key}\b", value, word) if key.isidentifier() else word.replace(key, value)
            return word

        argv = [fill(word) for word in shlex.split(line, comments=True)]
        if argv[:2] == ["ssh", "root@HOST"]:  # on the host: the embedded host is this machine
            argv = argv[2:] if len(argv) > 3 else shlex.split(argv[2])
        if argv[0] == "pct":
            return [str(self.deployed.sandbox.pct), *argv[1:]]
        if argv[0] == "invoke":
            return [sys.executable, "-m", "invoke", *argv[1:], "--inventory", self.inventory]
        raise AssertionError(f"{self.page}: the test cannot run the fix command {line!r}")

    def run(self, line: str, timeout: float = 600) -> subprocess.CompletedProcess:
        r = subprocess.run(self.argv(line), cwd=REPO, capture_output=True, text=True, timeout=timeout)
        print(f"$ {line}\nexit {r.returncode}\n{r.stdout}{r.stderr}")
        self.ran.append((line, r))
        return r

    def follow(self, lines: list[str], expect: dict | None = None) -> list[subprocess.CompletedProcess]:
        """Run each line; each must exit 0, or with the code `expect` gives it (a check the page says
        fails at that point)."""
        results = []
        for line in lines:
            r = self.run(line)
            want = (expect or {}).get(line, 0)
            assert r.returncode == want, f"{self.page}: `{line}` exited {r.returncode}, not {want}:\n" \
                                         f"{r.stdout}{r.stderr}"
            results.append(r)
        return results

    def check(self, run: str, *extra: str) -> subprocess.CompletedProcess:
        """`invoke status --check` of the run (the sandbox's disks are small: no free-space floor)."""
        return self.run(f"invoke status --run {run} --check --min-free 0 --min-free-shm 0 " + " ".join(extra))
