"""`invoke doctor`: preflight of one container in one round trip, one line per check, the fix when red.

The facts come from remote/facts.py (one `pct exec`); `checks()` turns them into verdicts and is
pure, so it is unit-tested on recorded facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from . import deploy, plan, terminal
from .errors import ConnectError, ContainerError, ContainerMissing, DflashOpsError, ExitStatus, SudoRefused
from .inventory import Container
from .remote import readings, ship
from .target import Target

MIN_FREE_SHM = 256 << 20    # NCCL and data-loader workers use /dev/shm beside the model kept there
MIN_FREE_RUNS = 1 << 30     # room for logs and at least a small checkpoint


class DoctorFailed(DflashOpsError, exit_status=ExitStatus.CHECK_FAILED):
    """At least one readiness check failed; the table names each one with its fix."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Local:
    """What the container is compared with: the local tree's hashes and the requirements' hash."""
    hashes: Mapping[str, str]
    requirements: str | None


def local_state(container: Container, root: Path = deploy.REPO_ROOT) -> Local:
    tree = deploy.local_tree(root)
    req = tree.get(deploy.REQUIREMENTS)
    want = deploy.requirements_hash(container, req.path.read_bytes()) if req else None
    return Local({rel: f.sha256 for rel, f in tree.items()}, want)


# --- verdicts (pure) --------------------------------------------------------------------------------

def gpu_check(ct: Container, fact: dict) -> Check:
    need = readings.gpus_needed(ct)
    if not fact.get("smi"):
        if need == 0:
            return Check("GPUs (nvidia-smi)", True, "no nvidia-smi in the container; the roles use CPU only")
        return Check("GPUs (nvidia-smi)", False, "nvidia-smi not found in the container",
                     "install the NVIDIA userspace driver in the container, the same version as the host's")
    if fact.get("rc") != 0:
        return Check("GPUs (nvidia-smi)", False, f"nvidia-smi failed: {fact.get('err') or fact.get('rc')}",
                     "the container's userspace driver must match the host's kernel driver; check "
                     "/dev/nvidia* passthrough in the container's LXC config")
    gpus = fact.get("gpus") or []
    names = sorted({g[1] for g in gpus if len(g) > 1})
    driver = next((g[3] for g in gpus if len(g) > 3), "?")
    detail = f"{len(gpus)} visible ({', '.join(names) or '-'}; driver {driver}), the roles need {need}"
    if len(gpus) < need:
        return Check("GPUs (nvidia-smi)", False, detail,
                     "pass the GPUs into the container (lxc.cgroup2.devices.allow + lxc.mount.entry "
                     "/dev/nvidia*) or fix roles in the inventory")
    return Check("GPUs (nvidia-smi)", True, detail)


def torch_check(ct: Container, venv_fact: dict) -> Check:
    info = readings.torch_info(venv_fact)
    if not info.ok:
        return Check("torch / CUDA", False, info.error,
                     "run `invoke deploy` (it rebuilds the venv if needed)")
    ok, message = readings.gpu_verdict(ct, info.gpus)
    return Check("torch / CUDA", ok, f"torch {info.version}, CUDA {info.cuda or 'none'}: {message}",
                 "" if ok
                 else "a torch build for this CUDA and the GPUs passed through; then `invoke deploy`")


def venv_check(ct: Container, fact: dict, local: Local) -> Check:
    if not fact.get("python"):
        return Check("venv", False, f"no python in {ct.paths.venv}", "run `invoke deploy` to create it")
    if local.requirements is None:
        return Check("venv", False, f"local {deploy.PAYLOAD}/{deploy.REQUIREMENTS} is missing",
                     "restore it in your checkout")
    if fact.get("requirements") != local.requirements:
        stamp = (fact.get("requirements") or "none")[:12]
        return Check("venv", False, f"{ct.paths.venv} was built from other requirements ({stamp}, local "
                     f"{local.requirements[:12]})", "run `invoke deploy` to refresh it")
    return Check("venv", True,
                 f"{ct.paths.venv}: python runs, requirements {local.requirements[:12]} current")


def code_check(ct: Container, fact: dict, local: Local) -> Check:
    if not fact.get("exists"):
        return Check("deployed code", False, f"{ct.paths.code} does not exist", "run `invoke deploy`")
    plan = deploy.make_plan(local.hashes, fact)
    if plan.up_to_date:
        return Check("deployed code", True, f"{ct.paths.code} = local tree (release {plan.release}, "
                     f"{len(local.hashes)} files)")
    differ = [*plan.changed, *plan.deleted]
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    detail = (f"{len(plan.changed)} file(s) differ or are missing, {len(plan.deleted)} extra: {shown}"
              if differ else "files match but the release layout or manifest is not deploy's")
    return Check("deployed code", False, detail, "run `invoke deploy`")


def model_check(ct: Container, fact: dict) -> Check:
    path = ct.paths.model
    if ct.tiny_target:
        fix = "run `invoke deploy` (the inventory asks for the tiny target)"
    elif ct.paths.model_store:
        fix = (f"run `invoke stage --ct {ct.ctid}` (copies {ct.paths.model_store}, checked by sha256; "
               "docs/runbooks/stage-target.md)")
    else:
        fix = (f"copy the model into {path} on the container (it must hold config.json and the weights), or "
               "set paths.model_store and run `invoke stage` (docs/runbooks/stage-target.md)")
    if not fact.get("dir"):
        return Check("model", False, f"{path} does not exist", fix)
    if not fact.get("config"):
        return Check("model", False, f"{path} has no config.json", fix)
    if fact.get("error"):
        return Check("model", False, f"{path}/config.json is unreadable: {fact['error']}", fix)
    kind = fact.get("model_type") or "?"
    if fact.get("multimodal"):
        kind += f" -> text config {fact.get('text_model_type') or '?'}"
    return Check("model", True, f"{path}: {kind}, hidden size {fact.get('hidden_size')}, "
                 f"{fact.get('layers')} layers")


SPACE_FIXES = {
    "free /dev/shm": "remove stale models or files in /dev/shm (on the host: `pct exec <id> -- ls -la "
                     "/dev/shm`), or raise the container's /dev/shm size; see docs/runbooks/disk-full.md",
    "free runs dir": "remove old runs or checkpoints under the runs directory, or grow the mount; "
                     "see docs/runbooks/disk-full.md",
}


def space_check(name: str, fact: dict, minimum: int) -> Check:
    free = fact.get("free")
    total = readings.human_bytes(fact.get("total"))
    detail = f"{readings.human_bytes(free)} free of {total} ({fact.get('path')})"
    if free is None or free < minimum:
        fix = SPACE_FIXES.get(name, "free space or grow the mount")
        return Check(name, False, detail, f"free at least {readings.human_bytes(minimum)}: {fix}")
    return Check(name, True, detail)


def cache_check(caches: dict) -> Check:
    parts = [f"{name} {readings.human_bytes(c.get('bytes'))} / {c.get('files', 0)} files" if c.get("exists")
             else f"{name} empty" for name, c in sorted(caches.items())]
    return Check("compile caches", True, "; ".join(parts) or "none configured")


def memory_check(fact: dict) -> Check:
    """The container's memory limit, beside the GPUs: a run over it is killed (SIGKILL) by the kernel."""
    limit, kills = fact.get("limit"), fact.get("oom_kills")
    shown = f"{limit >> 20} MiB limit" if isinstance(limit, int) else "no limit found"
    if isinstance(kills, int) and kills > 0:
        return Check("container memory", True, f"WARNING: {shown}; its OOM killer killed {kills} process(es) "
                     "since the container started", "docs/runbooks/container-oom.md")
    return Check("container memory", True, shown)


def layout_check(record: dict | None, target_gpus: int | None = None) -> Check:
    """The configured layout against the last `invoke plan` measurement: a warning, never a failure."""
    if not record:
        return Check("layout", True, "not measured: `invoke plan` measures the layouts of the GPUs")
    try:
        measured = plan.measured_from(record)
        configured = record.get("configured")
        devices = configured.get("target_devices") if isinstance(configured, dict) else None
        placement = configured.get("placement") if isinstance(configured, dict) else None
        if not isinstance(devices, list) or len(devices) > plan.MAX_GPUS or not isinstance(placement, str):
            raise ValueError("plan.json: field 'configured' is not a layout")
    except ValueError as exc:
        return Check("layout", False, terminal.visible(str(exc)), "run `invoke plan` again")
    if measured.gpus < 2:
        return Check("layout", True, "not measured: `invoke plan` measures the layouts of the GPUs")
    warning = plan.lagging(measured, target_gpus or len(devices), placement[:40])
    if warning:
        return Check("layout", True, f"WARNING: {warning}",
                     "`invoke plan` shows why; `invoke plan --write FILE` writes the best layout")
    return Check("layout", True,
                 f"within {100 - 100 * plan.LAGGING:.0f}% of the best layout `invoke plan` measured")


def checks(ct: Container, found: dict, local: Local) -> list[Check]:
    """Verdicts from one facts answer (the container answered, so it is running)."""
    run = found.get("alive")
    return [
        Check("container running", True, f"{ct.label} (hostname {found.get('hostname', '?')})"),
        gpu_check(ct, found.get("gpus") or {}),
        memory_check(found.get("memory") or {}),
        torch_check(ct, found.get("venv") or {}),
        venv_check(ct, found.get("venv") or {}, local),
        code_check(ct, found.get("code") or {}, local),
        model_check(ct, found.get("model") or {}),
        space_check("free /dev/shm", (found.get("space") or {}).get("shm") or {}, MIN_FREE_SHM),
        space_check("free runs dir", (found.get("space") or {}).get("runs") or {}, MIN_FREE_RUNS),
        cache_check(found.get("caches") or {}),
        Check("runs", True, f"run {run!r} is alive" if run else "no run alive"),
        layout_check(found.get("plan"), len(ct.roles.target) or None),
    ]


# --- the task -----------------------------------------------------------------------------------

def gather(t: Target, root: Path = deploy.REPO_ROOT) -> list[Check]:
    """One round trip, on a connection of its own (not a master's: reaching the host and its key
    are checked); a host or container that does not answer is itself the failed check."""
    ct = t.container
    local = local_state(ct, root)
    t.session.own_connection()
    try:
        result = ship.run(t, ship.facts_line(ct, ship.ALL_FACTS), f"{ct.label}: doctor",
                          timeout=deploy.FACTS_TIMEOUT_S)
    except SudoRefused as exc:
        return [Check("host reachable", False, str(exc), "allow pct in sudoers without a password "
                      "(docs/runbooks/pct-host.md)")]
    except ConnectError as exc:
        return [Check("host reachable", False, str(exc), "check the host's address, key and known_hosts "
                      "in the inventory")]
    except ContainerError as exc:
        fix = (f"`pct list` on {ct.host.name} shows the ids: fix the inventory"
               if isinstance(exc, ContainerMissing)
               else f"`pct start {ct.ctid}` on {ct.host.name}")
        return [Check("host reachable", True, f"{ct.host.user}@{ct.host.address}:{ct.host.port}"),
                Check("container running", False, str(exc), fix)]
    if t.dry_run:
        return []
    where = f"{ct.label}: doctor"
    found = ship.answer(result.stdout, where)
    if not isinstance(found, dict):
        raise ship.BadAnswer(f"{where}: the facts answer is not an object")
    for key, kind in FACT_TYPES.items():
        if found.get(key) is not None and not isinstance(found[key], kind):
            raise ship.BadAnswer(f"{where}: the answer's field {key!r} is not a {kind.__name__}")
    try:
        verdicts = checks(ct, found, local)
    except (TypeError, AttributeError, KeyError, ValueError, IndexError, OverflowError) as exc:
        raise ship.BadAnswer(f"{where}: a field inside the facts answer has the wrong type "
                             f"({type(exc).__name__}: {terminal.visible(str(exc))[:120]})") from None
    return [Check("host reachable", True, f"{ct.host.user}@{ct.host.address}:{ct.host.port}"), *verdicts]


# The facts answer's fields and their types (remote/facts.py); deeper values are checked where read.
FACT_TYPES = {"hostname": str, "alive": str, "gpus": dict, "venv": dict, "code": dict, "model": dict,
              "space": dict, "caches": dict, "plan": dict}


@dataclass
class Checkup:
    """Every check of one container: a table when it is the only one, a row in a fan-out."""

    container: Container
    checks: list[Check]

    @property
    def error(self) -> DoctorFailed | None:
        failed = [c.name for c in self.checks if not c.ok]
        if not failed:
            return None
        return DoctorFailed(f"doctor: {len(failed)} check(s) failed on {self.container.label}: "
                            f"{', '.join(failed)}")

    def describe(self) -> Table:
        table = Table(title=f"doctor: {self.container.label}", show_lines=False)
        for column in ("", "check", "result", "fix"):
            table.add_column(column, overflow="fold")
        for c in self.checks:
            mark = "[green]ok[/green]" if c.ok else "[bold red]FAIL[/bold red]"
            # details quote the container (the model's config.json, versions, paths): shown, never markup
            table.add_row(mark, terminal.markup(c.name), terminal.markup(c.detail), terminal.markup(c.fix))
        return table

    def facts(self) -> dict:
        """--json: every check (name, ok, detail, fix) and whether all passed (exit 1 when not)."""
        return {"container": self.container.label, "ok": all(c.ok for c in self.checks),
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "fix": c.fix}
                           for c in self.checks]}

    def row(self) -> str:
        failed = [c for c in self.checks if not c.ok]
        if failed:
            fixes = "; ".join(f"{c.name}: {c.detail}" + (f" -> {c.fix}" if c.fix else "") for c in failed)
            raise DoctorFailed(f"{len(failed)} of {len(self.checks)} checks failed: {fixes}")
        return f"all {len(self.checks)} checks passed"


def doctor(t: Target, root: Path = deploy.REPO_ROOT) -> Checkup:
    return Checkup(t.container, gather(t, root))
