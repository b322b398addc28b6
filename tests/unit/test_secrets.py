"""Secrets never show: not in a --dry-run line, not in the recorded environment, not in error messages,
whatever the value holds (quotes, newlines, `$()`); the real value is still what the line sends.

A name is secret when the inventory lists it in `secret_env` or it has TOKEN, SECRET, PASSWORD,
PASSWD, API_KEY, ACCESS_KEY or PRIVATE_KEY as a whole `_`-separated word (TOKENIZERS_PARALLELISM is not).
The container side (the value reaching the process, the run directory) is in
tests/integration/test_hostile_inputs.py.
"""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflash_ops import commands, launch
from dflash_ops.errors import ExitStatus
from dflash_ops.inventory import load_inventory
from dflash_ops.transport import HostSession

REPO = Path(__file__).resolve().parents[2]
SECRET_VALUES = ["hf_plain_s3cr3t", "it's a 's3cr3t'", 'dq"s3cr3t"', "s3cr3t with spaces", "$(id)s3cr3t",
                 "`id`s3cr3t", "s3cr3t;rm -rf /", "line1\ns3cr3t", "ünï s3cr3t €", "\\s3cr3t\\", "x" * 3000]
SECRET_NAMES = ["HF_TOKEN", "WANDB_API_KEY", "DB_PASSWORD", "MY_SECRET", "AWS_SECRET_ACCESS_KEY",
                "github_token",
                "SSH_PRIVATE_KEY", "ROOT_PASSWD"]


def inventory_with(tmp_path, env, secret_env=(), pip_env=None) -> Path:
    """One container on a loopback port nothing listens on: a dry run must not need a host."""
    base = tmp_path / "ct"
    inv = {"default_container": 200,
           "hosts": {"pve1": {"address": "127.0.0.1", "port": 9,
                              "known_hosts": str(tmp_path / "known_hosts")}},
           "containers": {200: {"host": "pve1", "roles": {"target": ["cpu"], "drafter": ["cpu"]},
                                "paths": {"venv": str(base / "venv"), "code": str(base / "code"),
                                          "runs": str(base / "runs"), "model": str(base / "model")},
                                "train_config": "configs/tiny-cpu.yaml", "env": env,
                                "secret_env": list(secret_env), "pip_env": pip_env or {}}}}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv, allow_unicode=True))
    return path


def assert_hidden(value: str, text: str) -> None:
    """Neither the value nor any spelling a shell would read back as it (quoted, or inside a quoted word)."""
    for form in (value, shlex.quote(value), value.replace("'", "'\"'\"'")):
        assert form not in text, text[:500]
    for line in text.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:  # not a shell line (a message): the checks above cover it
            continue
        assert not any(value in word for word in words), line[:500]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_looking_names_are_masked_and_ordinary_ones_are_not(tmp_path, name):
    inv = load_inventory(str(inventory_with(tmp_path, {name: "v4lue", "TOKENIZERS_PARALLELISM": "false"})))
    assert inv.containers[200].secret_values() == ("v4lue",)


@pytest.mark.parametrize("task", [["train", "--run", "r1"], ["warmup"]])  # deploy: below
def test_dry_run_of_every_task_that_sends_the_env_shows_no_secret_value(tmp_path, task):
    env = {f"S{i}_TOKEN": v for i, v in enumerate(SECRET_VALUES)}
    env["CUSTOM_NAME"] = "listed-by-name-s3cr3t"
    pip_env = {"PIP_INDEX_URL": "https://user:pip-s3cr3t@pypi.example/simple"}
    inventory = inventory_with(tmp_path, env, secret_env=["CUSTOM_NAME", "PIP_INDEX_URL"], pip_env=pip_env)
    r = subprocess.run([sys.executable, "-m", "invoke", *task, "--dry-run", "--inventory", str(inventory)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == ExitStatus.OK, r.stderr
    for value in [*env.values(), *pip_env.values()]:
        assert_hidden(value, r.stdout + r.stderr)
    assert commands.MASK in r.stdout


def test_recorded_environment_and_launch_record_are_masked_but_the_line_carries_the_value(tmp_path):
    env = {f"S{i}_TOKEN": v for i, v in enumerate(SECRET_VALUES)}
    ct = load_inventory(str(inventory_with(tmp_path, env))).containers[200]
    argv, _ = launch.launch_argv(ct, "r1", sets=["data.assistant_header=plain"])
    payload = json.loads(argv[-1])  # python -c LOADER SCRIPT launch PAYLOAD
    env_text, launch_json = payload["env"], payload["launch"]
    for name, value in env.items():
        assert f"{name}={commands.MASK}" in env_text.splitlines()
        assert value not in env_text and value not in launch_json
    line = commands.pct_exec(ct.ctid, argv, env=ct.run_env(), cwd=ct.paths.code)
    sent = shlex.split(line)
    assert all(f"{name}={value}" in sent for name, value in env.items())  # the real values travel


def test_error_messages_mask_secret_values_from_the_remote_stderr(tmp_path):
    value = "it's a 's3cr3t'"
    ct = load_inventory(str(inventory_with(tmp_path, {"HF_TOKEN": value}))).containers[200]
    session = HostSession(ct.host, secrets=ct.secret_values())
    assert session.shown(f"bash: {value}: command not found | {shlex.quote(value)}") == \
        f"bash: {commands.MASK}: command not found | {commands.MASK}"


def test_inventory_errors_do_not_echo_env_values(tmp_path):
    path = inventory_with(tmp_path, {})
    text = path.read_text().replace("env: {}", 'env: {HF_TOKEN: "s3cr3t\\0nul"}')
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "invoke", "train", "--dry-run", "--inventory", str(path)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == ExitStatus.USAGE and "HF_TOKEN" in r.stderr and "NUL" in r.stderr
    assert "s3cr3t" not in r.stdout + r.stderr


SECRET = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                 min_size=6, max_size=40)


@settings(max_examples=150, deadline=None)
@given(value=SECRET, other=st.text(alphabet="abc $'\"\n;", max_size=12))
def test_property_a_masked_line_never_shows_the_secret_and_the_sent_line_carries_it(value, other):
    env = {"HF_TOKEN": value, "PLAIN": other}
    skeleton = commands.pct_exec(200, ["python", "train.py", f"--set=x={other}"],
                                 env={"HF_TOKEN": "", "PLAIN": other})
    assume(value not in skeleton and value.strip() and commands.MASK not in value)
    line = commands.pct_exec(200, ["python", "train.py", f"--set=x={other}"], env=env)
    assert f"HF_TOKEN={value}" in shlex.split(line)  # sent as is
    assert_hidden(value, commands.mask(line, [value]))


def test_deploys_plan_shows_no_secret_value_in_its_exact_lines(tmp_path, monkeypatch):
    """deploy --dry-run -v reads the container first (here: a container without code or venv, so every
    step is planned, pip's environment included); its exact lines are masked as every dry run's."""
    from dflash_ops import deploy, target
    from dflash_ops.remote import ship

    env = {f"S{i}_TOKEN": v for i, v in enumerate(SECRET_VALUES)}
    env["CUSTOM_NAME"] = "listed-by-name-s3cr3t"
    pip_env = {"PIP_INDEX_URL": "https://user:pip-s3cr3t@pypi.example/simple"}
    inventory = inventory_with(tmp_path, env, secret_env=["CUSTOM_NAME", "PIP_INDEX_URL"], pip_env=pip_env)
    monkeypatch.setattr(ship, "facts", lambda *args, **kwargs: {})  # the read: nothing deployed yet
    plan = deploy.deploy(target.resolve_one(str(inventory), None, dry_run=True), verbose=True)
    text = plan.describe()
    assert "venv: create " in text and "create the venv with pip" in text
    for value in [*env.values(), *pip_env.values()]:
        assert_hidden(value, text)
    assert commands.MASK in text
