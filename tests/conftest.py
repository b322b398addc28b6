"""Fixtures for tests against the embedded Proxmox host (real sshd on 127.0.0.1, real LXC containers),
shared by tests/integration and tests/conformance, and the conformance suite's options.

`--inventory FILE --ct ID [--stopped-ct ID]`: tests/conformance checks that host instead of the
embedded one (README, "Pointing it at a real host").

`sandbox` (session-scoped): one sandbox host `pve1` with container 200 running and 201 created but
stopped; it is a `dflash_ops.sandbox.Sandbox` (inventory path, port, key, known_hosts, state_dir,
pct, host(name), ssh_argv(command)). Torn down at the end of the session.
`sandbox_factory(**layout)` (session-scoped): more sandboxes, each in its own state dir with its own
sshd(s), e.g. `sandbox_factory(containers=(200,), hosts=2)`; all torn down at the end. The state lives in a
temporary dir, or in $DFLASH_TEST_SANDBOX_STATE when set (kept between sessions, so a venv built in container
200 survives: faster reruns; one dir per xdist worker inside it).
`template` (session-scoped): a deployed container's venv and tiny target, built once per run for
all xdist workers; `ct_template.seed(template, sandbox)` gives them to a container so that its
`invoke deploy` ships only the code. Tests about a fresh deploy use an unseeded container.
It is kept between runs in .test-cache/ (or $DFLASH_TEST_TEMPLATE; `off`: not kept).

Tiers: each test gets the marker of its directory (tests/unit: `unit`, tests/integration and
tests/conformance: `integration`, tests/remote: `training`), so `-m unit` selects a tier.

Workers (`scripts/test` runs `-n` workers with `--dist loadfile`): a test file runs whole on one
worker, so its module-scoped fixtures (a deployed container, a trained run) are built once. Files
start longest first, by the durations the last run recorded (.pytest_cache), so one slow file does
not finish alone at the end. Each worker has its own embedded hosts (its own temporary dirs, sshd
ports, containers). `run_once(name, build)` does a piece of work once per run for all workers.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from pathlib import Path

import pytest
from ct_template import build_template, prune, template_key
from parallel import file_lock, run_dir, worker

from dflash_ops import sandbox as sandbox_mod

TESTS = Path(__file__).resolve().parent
# Connection sharing between invocations (dflash_ops.mux) is off for the suite, so that no test meets
# another's connection; tests/integration/test_shared_connection.py turns it on for itself. Export
# DFLASH_CONTROL_PERSIST=60 to run the whole suite with it on.
os.environ.setdefault("DFLASH_CONTROL_PERSIST", "0")
# The containers' processes (training runs a test keeps alive while it works the CLI) yield the CPU
# to the tests' own processes: each container's cgroup weight is a quarter of Proxmox's default
# (sandbox/pct writes `cpuunits` as the LXC cgroup's weight). Export DFLASH_SANDBOX_CPUUNITS=100 for
# the default weight.
os.environ.setdefault("DFLASH_SANDBOX_CPUUNITS", "25")
TIERS = {"unit": "unit", "integration": "integration", "conformance": "integration", "remote": "training"}
# Before a run has recorded durations, a guess per test: the slow tiers' files first.
FIRST_RUN_SECONDS_PER_TEST = {"integration": 10.0, "remote": 3.0, "unit": 0.1}
DURATIONS_KEY = "dflash/file-durations"


def _file_of(item) -> str:
    return Path(str(item.path)).resolve().relative_to(TESTS).as_posix()


def pytest_collection_modifyitems(config, items):
    tests_in = {}  # file -> number of its tests
    for item in items:
        top = _file_of(item).split("/")[0]
        if top in TIERS:
            item.add_marker(TIERS[top])
        tests_in[_file_of(item)] = tests_in.get(_file_of(item), 0) + 1
    if worker() == "main":
        return  # one process: the files' own order
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    known = cache.get(DURATIONS_KEY, {}) if cache else {}
    seconds = {}
    for name, count in tests_in.items():
        guess = FIRST_RUN_SECONDS_PER_TEST.get(name.split("/")[0], 1.0) * count
        seconds[name] = known.get(name, guess)
    # Stable: a file's tests keep their order.
    items.sort(key=lambda item: (-seconds[_file_of(item)], _file_of(item)))


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    if path.startswith("tests/"):
        name = path.removeprefix("tests/")
        _durations[name] = _durations.get(name, 0.0) + report.duration


def pytest_sessionfinish(session):
    # The controller sees every worker's reports; a worker would record only its own files.
    if worker() == "main" and getattr(session.config, "cache", None) and _durations:
        known = session.config.cache.get(DURATIONS_KEY, {})
        session.config.cache.set(DURATIONS_KEY, {**known, **{k: round(v, 1) for k, v in _durations.items()}})


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
    """run_once(name, build, where=None) -> the directory `where`/name (default: this run's shared
    temporary dir), made by build(directory) once, by whichever worker asks first while the others
    wait; kept and reused when already built. A build that failed fails this run's later asks."""
    shared = run_dir(tmp_path_factory)

    def once(name: str, build, where: Path | None = None) -> Path:
        out = (where or shared) / name
        out.parent.mkdir(parents=True, exist_ok=True)
        failed = shared / f"{name}.failed"
        with file_lock(out.parent / f"{name}.lock"):
            if failed.exists():
                pytest.fail(f"{name} could not be built (by another worker):\n{failed.read_text()}")
            if not (out / ".built").exists():
                started = time.monotonic()
                shutil.rmtree(out, ignore_errors=True)  # what a killed build left
                out.mkdir()
                try:
                    build(out)
                except BaseException:
                    failed.write_text(traceback.format_exc())
                    raise
                (out / ".built").write_text(f"{worker()} {time.monotonic() - started:.1f}s\n")
        return out

    return once


def pytest_addoption(parser):
    group = parser.getgroup("conformance", "tests/conformance against a real Proxmox host")
    group.addoption("--inventory", default=None,
                    help="inventory whose host and container the conformance suite checks "
                                                      "(default: the embedded host)")
    group.addoption("--ct", default=None,
                    help="a running container of that inventory (default: its default container); "
                                              "only a scratch dir under its /tmp is written, then removed")
    group.addoption("--stopped-ct", default=None,
                    help="a stopped container on the same host, for the stopped-container "
                                                      "checks (skipped without it on a real host); "
                                                      "never started")


def bring_up(state_dir, **layout):
    """A sandbox in `state_dir`, its inventory next to its state; skipped (not failed) without root."""
    if os.geteuid() != 0:
        pytest.skip("the embedded host needs root (sshd, LXC containers)")
    sb = sandbox_mod.up(state_dir, inventory_path=os.path.join(state_dir, "sandbox.yaml"), **layout)
    sandbox_mod.watch(sb.state_dir, os.getpid())  # a session killed before teardown leaves nothing running
    return sb


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    kept = os.environ.get("DFLASH_TEST_SANDBOX_STATE")
    state = os.path.join(kept, worker()) if kept else str(tmp_path_factory.mktemp("sandbox"))
    sb = bring_up(state, containers=(200,), stopped=(201,))
    try:
        yield sb
    finally:
        sandbox_mod.down(sb.state_dir)


@pytest.fixture(scope="session")
def sandbox_factory(tmp_path_factory):
    made = []

    def make(**layout):
        sb = bring_up(str(tmp_path_factory.mktemp("sandbox")), **layout)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            sandbox_mod.down(sb.state_dir)


# Where templates are kept between runs, as .venv is: git-ignored, one per key (ct_template.prune).
KEPT_TEMPLATES = TESTS.parent / ".test-cache"


@pytest.fixture(scope="session")
def template(run_once):
    """The deployed-container template (venv, tiny target), built by whichever worker asks first and
    kept for later runs in .test-cache/ ($DFLASH_TEST_TEMPLATE=DIR: there instead; =off: this run's
    temporary dir), used while what it is built from is unchanged (ct_template.template_key)."""
    setting = os.environ.get("DFLASH_TEST_TEMPLATE", "")
    kept = None if setting == "off" else Path(setting) if setting else KEPT_TEMPLATES
    name = f"ct-template-{template_key()}"

    def build(out: Path) -> None:
        if kept is not None:
            prune(kept, name)
        build_template(out, bring_up)

    return run_once(name, build, kept)
