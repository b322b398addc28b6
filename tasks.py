"""dflash-ops tasks: `invoke --list` shows them, `invoke --help TASK` explains one.

Glue only: parse flags, pick the target, call one library function. No shell strings here.
"""

from invoke import Collection

from dflash_ops import cli
from dflash_ops.cli import op_task
from dflash_ops.errors import UsageError


# --- host keys ------------------------------------------------------------------------------------
@op_task(help={"host": "host name from the inventory",
               "fingerprint": "the SHA256:... fingerprint you verified out of band"})
def trust_host(c, host, fingerprint=None, inventory=None):
    """Pin a host's SSH key deliberately (shows the offered key; pins it only if --fingerprint matches).

    dflash-ops never trusts a new or changed host key on its own. Get the key's fingerprint from
    the host's console (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`), then run this task with
    `--fingerprint` to write it to the host's known_hosts file.
    """
    from dflash_ops import transport
    from dflash_ops.inventory import load_inventory

    inv = load_inventory(cli.inventory_path(c, inventory))
    if host not in inv.hosts:
        raise UsageError(f"no host {host!r} in {inv.path} (known: {', '.join(sorted(inv.hosts))})")
    h = inv.hosts[host]
    key = transport.HostSession(h).offered_host_key()
    offered = transport.fingerprint(key)
    print(f"{h.name} ({h.address}:{h.port}) offers {key.get_name()} {offered}")
    if fingerprint is None:
        print(f"not pinned: re-run with --fingerprint {offered} once you have checked it on the host")
        return
    if fingerprint.strip() != offered:
        raise UsageError(f"fingerprint mismatch: you gave {fingerprint}, the host offers {offered}; nothing pinned")
    print(f"pinned in {transport.pin_host_key(h, key)}")


# --- the embedded host ----------------------------------------------------------------------------
@op_task(help={"containers": "container ids to create, e.g. 200 or 200,201",
               "hosts": "how many embedded hosts (each its own sshd on 127.0.0.1)"})
def sandbox_up(c, containers="200", hosts=1):
    """Start the embedded Proxmox host (sshd on 127.0.0.1 + pct) and write inventory/sandbox.yaml."""
    from dflash_ops import sandbox

    try:
        ids = tuple(int(x) for x in str(containers).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--containers {containers!r}: give ids such as 200 or 200,201") from None
    _report(sandbox.up(containers=ids, hosts=int(hosts)))


@op_task
def sandbox_down(c):
    """Stop the embedded host: every container, every sshd; nothing is left running."""
    from dflash_ops import sandbox

    _report(sandbox.down())


@op_task
def sandbox_status(c):
    """Show the embedded host's sshd and containers."""
    from dflash_ops import sandbox

    print(sandbox.status().describe())


def _report(result) -> None:
    for change in result.changed or ("nothing to do: already as asked",):
        print(change)
    print(result.describe())


# --- deploy, doctor, compile caches ---------------------------------------------------------------
@op_task
def deploy(c, ct=None, dry_run=False, inventory=None):
    """Ship remote_scripts/ into the container, refresh its venv if the requirements changed, check torch.

    Only files whose sha256 differs from the container's copy travel, as one tar over SFTP; the
    container stages a new release from the current one plus those files and swaps the
    `paths.code` symlink to it atomically, so an interrupted deploy leaves the previous release
    whole (the last three releases are kept). The venv (`paths.venv`) is created or refreshed with
    pip only when remote_scripts/requirements.txt changed, with pip's output shown. Ends by checking
    that torch imports in the container and sees the GPUs the inventory's roles name, and creates
    the tiny target model when the inventory asks for one. Nothing changed: one round trip.
    """
    from dflash_ops import deploy as deploy_mod

    report = deploy_mod.deploy(cli.target(c, ct, inventory, dry_run))
    if not dry_run:
        print(deploy_mod.describe(report))


@op_task
def doctor(c, ct=None, dry_run=False, inventory=None):
    """Check the container is ready to train: one line per check, the fix for each that fails.

    One round trip gathers everything: container running, GPUs seen by nvidia-smi against the
    inventory's roles, torch and CUDA versions and the GPUs torch sees, the venv (python runs,
    built from the current requirements), the deployed code against the local remote_scripts/,
    the model directory and its config (a multimodal config's text part), free space in /dev/shm
    and in the runs directory, and the compile caches' size. Exits non-zero if any check fails.
    """
    from dflash_ops import doctor as doctor_mod

    doctor_mod.doctor(cli.target(c, ct, inventory, dry_run))


@op_task(help={"force": "clean even while a run is alive (its compile caches disappear under it)"})
def clean_cache(c, force=False, ct=None, dry_run=False, inventory=None):
    """Remove the container's compile caches (inductor, triton, torch extensions) and say what was freed.

    The directories are the inventory's `paths.caches`. Refused while a run is alive (it holds
    the runs lock and uses the caches) unless --force; the next warm-up fills them again.
    """
    from dflash_ops import caches

    freed = caches.clean_cache(cli.target(c, ct, inventory, dry_run), force=force)
    if not dry_run:
        print(caches.describe(freed))


sandbox_ns = Collection("sandbox")
sandbox_ns.add_task(sandbox_up, "up")
sandbox_ns.add_task(sandbox_down, "down")
sandbox_ns.add_task(sandbox_status, "status")

ns = Collection(trust_host, sandbox_ns, deploy, doctor, clean_cache)
ns.configure({"dflash": {"inventory": None}})
