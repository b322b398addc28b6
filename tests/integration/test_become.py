"""`become: sudo` on the embedded host with real users who are not root: `sudo -n pct` where sudoers
allows pct without a password; a sudo that wants one is one clear line and an exit code, never a hang.

Users and a sudoers drop-in are made on this machine for the module and removed afterwards (the
embedded host is this machine: its sshd lets them in with the client key).
"""

import os
import pwd
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_ops import transport
from dflash_ops.errors import AuthFailed, ExitStatus
from dflash_ops.inventory import load_inventory

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ALLOWED, PASSWORD = "dfops-sudo", "dfops-pw"  # sudo runs pct without a password / wants a password
SUDOERS = Path("/etc/sudoers.d/dflash-ops-test")
CT = 240


@pytest.fixture(scope="module")
def host(sandbox_factory):
    sb = sandbox_factory(containers=(CT,), logins=(ALLOWED, PASSWORD))
    assert os.access("/usr/bin/sudo", os.X_OK), "no sudo: run scripts/bootstrap (apt-get install sudo)"
    made = []
    for user in (ALLOWED, PASSWORD):
        try:
            pwd.getpwnam(user)
        except KeyError:
            # '*': no password to log in with, yet not a locked account (sshd without PAM refuses those).
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--password", "*", user],
                           check=True)
            made.append(user)
    SUDOERS.write_text(f"{ALLOWED} ALL=(root) NOPASSWD: {sb.pct}\n{PASSWORD} ALL=(root) ALL\n")
    SUDOERS.chmod(0o440)
    try:
        subprocess.run(["visudo", "-c", "-q", "-f", str(SUDOERS)], check=True)
        yield sb
    finally:
        SUDOERS.unlink(missing_ok=True)
        for user in made:
            subprocess.run(["userdel", "--remove", user], capture_output=True)


def inventory_as(sb, tmp_path, user: str, become: str | None = "sudo") -> str:
    data = yaml.safe_load(Path(sb.inventory).read_text())
    data["hosts"]["pve1"].update(user=user, become=become)
    path = tmp_path / f"{user}.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return str(path)


def invoke(*args):
    return subprocess.run([str(REPO / ".venv/bin/invoke"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_a_user_allowed_pct_by_sudo_runs_commands_as_root_in_the_container(host, tmp_path):
    inv = load_inventory(inventory_as(host, tmp_path, ALLOWED))
    ct = inv.container(CT)
    s = transport.HostSession(ct.host)
    try:
        assert s.exec(ct, ["sh", "-c", "id -u; hostname"]).stdout.split() == ["0", f"ct{CT}"]
        # sudo passes LC_ALL on: pct decodes the arguments as UTF-8 (a one-time check, then the line).
        assert s.exec(ct, ["printf", "%s", "ünï €"]).stdout == "ünï €"
        assert s.exec(ct, ["sh", "-c", "exit 7"], check=False).exited == 7
    finally:
        s.close()


def test_a_sudo_that_wants_a_password_is_one_line_and_exit_3(host, tmp_path):
    inventory = inventory_as(host, tmp_path, PASSWORD)
    inv = load_inventory(inventory)
    ct = inv.container(CT)
    s = transport.HostSession(ct.host)
    with pytest.raises(AuthFailed) as err:
        s.exec(ct, ["true"])
    s.close()
    assert f"sudo wants a password for user {PASSWORD}" in str(err.value) and "NOPASSWD" in str(err.value)
    r = invoke("status", "--inventory", inventory, "--ct", str(CT))  # the CLI: bounded by the timeout
    lines = r.stderr.strip().splitlines()
    assert r.returncode == ExitStatus.UNREACHABLE, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    assert "sudo wants a password" in lines[0]
    r = invoke("doctor", "--inventory", inventory, "--ct", str(CT))
    assert r.returncode == ExitStatus.CHECK_FAILED
    assert "FAIL" in r.stdout and "allow pct in sudoers without a password" in r.stdout
