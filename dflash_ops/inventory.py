"""The inventory: hosts, containers, GPU roles, paths and environment, from YAML into frozen dataclasses.

Every problem is reported as `InventoryError("<file>: <key>: <reason>")`, so a broken inventory is
fixed from the message alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import commands, localfiles, mux
from .errors import InventoryError

DEFAULT_INVENTORY = "inventory/production.yaml"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
PACKAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
# Whole words of a variable name: HF_TOKEN and DB_PASSWORD are secrets, TOKENIZERS_PARALLELISM is not.
SECRET_NAME = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY)(_|$)",
                         re.IGNORECASE)
MIN_CTID, MAX_CTID = 100, 999_999_999  # Proxmox VMIDs


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    port: int = 22
    user: str = "root"
    key: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    jump: str | None = None
    node: str | None = None
    pct: str = "pct"
    become: str | None = None  # "sudo": pct runs as `sudo -n pct` for a user who is not root
    # Seconds a master keeps the connection open for the next tasks (dflash_ops.mux); 0: off.
    control_persist: int = mux.DEFAULT_PERSIST

    @property
    def node_name(self) -> str:
        return self.node or self.name

    @property
    def pct_command(self) -> list[str]:
        """The argv that starts pct on this host (commands.pct_argv)."""
        return commands.pct_argv(self.pct, self.become)


@dataclass(frozen=True)
class Caches:
    inductor: str = "/root/.cache/dflash/inductor"
    triton: str = "/root/.cache/dflash/triton"
    torch_extensions: str = "/root/.cache/torch_extensions"

    def env(self) -> dict[str, str]:
        """The variables that point torch's compile caches at these directories."""
        return {
            "TORCHINDUCTOR_CACHE_DIR": self.inductor,
            "TRITON_CACHE_DIR": self.triton,
            "TORCH_EXTENSIONS_DIR": self.torch_extensions,
        }

    def all(self) -> dict[str, str]:
        return {"inductor": self.inductor, "triton": self.triton, "torch_extensions": self.torch_extensions}


@dataclass(frozen=True)
class Paths:
    venv: str = "/root/venv"
    code: str = "/root/dflash"
    runs: str = "/root/runs"
    model: str = "/dev/shm/model"
    model_store: str | None = None  # the target's persistent copy in the container, `invoke stage` copies
    data: str | None = None
    caches: Caches = field(default_factory=Caches)


@dataclass(frozen=True)
class Roles:
    target: tuple = ()
    drafter: tuple = ()

    def devices(self, role: str) -> str:
        """`[0, 1]` -> `cuda:0,cuda:1`; `[cpu, cpu]` -> `cpu,cpu`."""
        entries = getattr(self, role)
        return ",".join("cpu" if e == "cpu" else f"cuda:{e}" for e in entries)

    @property
    def gpus(self) -> tuple:
        return tuple(sorted({e for e in (*self.target, *self.drafter) if e != "cpu"}))


@dataclass(frozen=True)
class Container:
    ctid: int
    host: Host
    name: str = ""
    roles: Roles = field(default_factory=Roles)
    python: str = "/usr/bin/python3"
    tiny_target: bool = False
    tiny_target_fit_steps: int = 0
    target_package: str | None = None  # a pip package shipping a GGUF target (container/real_target.py)
    paths: Paths = field(default_factory=Paths)
    train_config: str = "configs/production-27b.yaml"
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: tuple = ()
    pip_env: Mapping[str, str] = field(default_factory=dict)
    rdzv_address: str | None = None  # multi-node training: where other nodes reach this container

    @property
    def label(self) -> str:
        return f"{self.host.name}/{self.ctid}"

    @property
    def venv_python(self) -> str:
        return f"{self.paths.venv}/bin/python"

    def run_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The complete environment for warm-up, training and evaluation inside the container.

        `pct exec` passes no environment and forces PATH, so everything is spelled out: the venv
        first on PATH, the compile caches that warm-up and training share, then the inventory's env.
        """
        env = {
            "PATH": f"{self.paths.venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "VIRTUAL_ENV": self.paths.venv,
            "PYTHONUNBUFFERED": "1",
        }
        env.update(self.paths.caches.env())
        env.update(self.env)
        env.update(extra or {})
        return env

    def secret_values(self) -> tuple[str, ...]:
        """Values to mask in anything printed: named secrets and names that look like secrets."""
        values = []
        for mapping in (self.env, self.pip_env):
            for name, value in mapping.items():
                if value and (name in self.secret_env or SECRET_NAME.search(name)):
                    values.append(value)
        return tuple(values)


@dataclass(frozen=True)
class Inventory:
    path: str
    hosts: Mapping[str, Host]
    containers: Mapping[int, Container]
    groups: Mapping[str, tuple]
    default_container: int | None = None

    def container(self, ctid: int | str | None) -> Container:
        if ctid is None or ctid == "":
            if self.default_container is None:
                raise InventoryError(f"{self.path}: no --ct given and no default_container set")
            ctid = self.default_container
        try:
            key = int(ctid)
        except (TypeError, ValueError):
            raise InventoryError(f"--ct {ctid!r}: a container id is a number such as 200") from None
        if key not in self.containers:
            known = ", ".join(str(c) for c in sorted(self.containers)) or "none"
            raise InventoryError(f"{self.path}: container {key} is not in the inventory (known: {known})")
        return self.containers[key]

    def select(self, ct: str | int | None = None, group: str | None = None) -> list[Container]:
        """`--ct 200,201` or `--group NAME` -> containers, in order, without repeats."""
        if ct not in (None, "") and group:
            raise InventoryError("give --ct or --group, not both")
        if group:
            if group not in self.groups:
                known = ", ".join(sorted(self.groups)) or "none"
                raise InventoryError(f"{self.path}: group {group!r} is not defined (known: {known})")
            ids = list(self.groups[group])
        elif ct in (None, ""):
            ids = [None]
        else:
            ids = [p.strip() for p in str(ct).split(",") if p.strip()]
        seen, out = set(), []
        for i in ids:
            c = self.container(i)
            if c.ctid not in seen:
                seen.add(c.ctid)
                out.append(c)
        return out


# --- loading ---------------------------------------------------------------------------------------

class _Reader:
    """Walks the parsed YAML, checking keys and types, and names the failing key path."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, key: str, reason: str):
        raise InventoryError(f"{self.path}: {key}: {reason}")

    def mapping(self, value, key: str, allowed: set[str] | None = None, required: set[str] = frozenset()):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.fail(key, f"must be a mapping, got {type(value).__name__}")
        if allowed is not None:
            unknown = sorted(str(k) for k in value if k not in allowed)
            if unknown:
                self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                          f"unknown key (allowed: {', '.join(sorted(allowed))})")
        for req in sorted(required):
            if req not in value:
                self.fail(f"{key}.{req}" if key else req, "required key is missing")
        return value

    def typed(self, value, key: str, kind, *, optional=False):
        if value is None and optional:
            return None
        if kind is int and isinstance(value, bool):
            self.fail(key, "must be an integer, got a boolean")
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            self.fail(key, f"must be {names}, got {type(value).__name__} ({value!r})")
        return value

    def text(self, value, key: str, *, optional=False):
        value = self.typed(value, key, str, optional=optional)
        if value is not None and ("\x00" in value or "\n" in value):
            self.fail(key, "must not contain NUL or newline characters")
        return value

    def abspath(self, value, key: str, *, optional=False):
        value = self.text(value, key, optional=optional)
        if value is not None and not value.startswith("/"):
            self.fail(key, f"must be an absolute path inside the container, got {value!r}")
        return value

    def env(self, value, key: str) -> dict[str, str]:
        value = self.mapping(value, key)
        out = {}
        for name, val in value.items():
            if not isinstance(name, str) or not ENV_NAME.match(name):
                self.fail(f"{key}.{name}",
                          "malformed environment variable name (want [A-Za-z_][A-Za-z0-9_]*)")
            if not isinstance(val, str):
                self.fail(f"{key}.{name}",
                          f"value must be a string (quote it in YAML), got {type(val).__name__}")
            if "\x00" in val:
                self.fail(f"{key}.{name}", "value must not contain a NUL byte")
            out[name] = val
        return out


HOST_KEYS = {"address", "port", "user", "key", "known_hosts", "jump", "node", "pct", "become",
             "control_persist"}
CONTAINER_KEYS = {"host", "name", "roles", "python", "tiny_target", "tiny_target_fit_steps",
                  "target_package", "paths",
                  "train_config", "env",
                  "secret_env", "pip_env", "rdzv_address"}
PATH_KEYS = {"venv", "code", "runs", "model", "model_store", "data", "caches"}
CACHE_KEYS = {"inductor", "triton", "torch_extensions"}
TOP_KEYS = {"default_container", "hosts", "containers", "groups"}


def _expand(path: str | None, base: Path) -> str | None:
    """Local file paths in the inventory: `~` expanded, relative ones taken from the inventory's folder."""
    if path is None:
        return None
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else (base / p))


def _ctid(r: _Reader, raw, key: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, str)) or not str(raw).isdigit():
        r.fail(key, f"container id must be a number such as 200, got {raw!r}")
    ctid = int(raw)
    if not MIN_CTID <= ctid <= MAX_CTID:
        r.fail(key, f"container id must be between {MIN_CTID} and {MAX_CTID}, got {ctid}")
    return ctid


def _host(r: _Reader, name, raw, base: Path) -> Host:
    key = f"hosts.{name}"
    if not isinstance(name, str) or not HOST_NAME.match(name):
        r.fail(key, "host names use letters, digits, '.', '_' and '-'")
    raw = r.mapping(raw, key, HOST_KEYS, required={"address"})
    address = _address(r, raw["address"], f"{key}.address")
    port = r.typed(raw.get("port", 22), f"{key}.port", int)
    if not 1 <= port <= 65535:
        r.fail(f"{key}.port", f"must be 1..65535, got {port}")
    persist = r.typed(raw.get("control_persist", mux.DEFAULT_PERSIST), f"{key}.control_persist", int)
    if not 0 <= persist <= mux.MAX_PERSIST:
        r.fail(f"{key}.control_persist", f"must be 0 (off) to {mux.MAX_PERSIST} seconds, got {persist}")
    user = r.text(raw.get("user", "root"), f"{key}.user")
    if not re.match(r"^[a-z_][a-z0-9_.-]*$", user):
        r.fail(f"{key}.user", f"not a valid user name: {user!r}")
    return Host(
        name=name,
        address=address,
        port=port,
        user=user,
        key=_expand(r.text(raw.get("key"), f"{key}.key", optional=True), base),
        known_hosts=_expand(r.text(raw.get("known_hosts", "~/.ssh/known_hosts"), f"{key}.known_hosts"), base),
        jump=r.text(raw.get("jump"), f"{key}.jump", optional=True),
        node=r.text(raw.get("node"), f"{key}.node", optional=True),
        pct=_pct(r, raw.get("pct", "pct"), f"{key}.pct"),
        become=_become(r, raw.get("become"), f"{key}.become"),
        control_persist=persist,
    )


def _become(r: _Reader, raw, key: str) -> str | None:
    if raw is not None and raw not in commands.BECOME:
        r.fail(key, f"must be one of {', '.join(commands.BECOME)} (or left out when the user is root), "
                    f"got {raw!r}")
    return raw


def _pct(r: _Reader, raw, key: str) -> str:
    """A command name or path: one starting with `-` would be read as an option (of sudo, of env)."""
    pct = r.text(raw, key)
    if not pct or pct.startswith("-"):
        r.fail(key, f"must be the pct command or its path (not empty, not starting with '-'), got {pct!r}")
    return pct


def _address(r: _Reader, raw, key: str, *, optional=False) -> str | None:
    address = r.text(raw, key, optional=optional)
    if address is not None and (not address or address.startswith("-")
                                or any(ch.isspace() for ch in address)):
        r.fail(key, f"not a host name or address: {address!r}")
    return address


def _rdzv_address(r: _Reader, raw, key: str) -> str | None:
    """Becomes `ADDRESS:PORT` for torchrun: an IPv6 address must be written in brackets."""
    address = _address(r, raw, key, optional=True)
    if address is not None and ":" in address and not (address.startswith("[") and address.endswith("]")):
        r.fail(key, f"write an IPv6 address in brackets, e.g. [fd00::2], got {address!r}")
    return address


def _roles(r: _Reader, raw, key: str) -> Roles:
    raw = r.mapping(raw, key, {"target", "drafter"})
    out = {}
    for role in ("target", "drafter"):
        entries = raw.get(role, [])
        if not isinstance(entries, list):
            r.fail(f"{key}.{role}", "must be a list of GPU indices or 'cpu'")
        for e in entries:
            if not (e == "cpu" or (isinstance(e, int) and not isinstance(e, bool) and 0 <= e < 64)):
                r.fail(f"{key}.{role}", f"entries are GPU indices 0..63 or 'cpu', got {e!r}")
        out[role] = tuple(entries)
    overlap = {e for e in out["target"] if e != "cpu"} & {e for e in out["drafter"] if e != "cpu"}
    if overlap:
        r.fail(key, f"GPU {sorted(overlap)[0]} is both a target and a drafter GPU")
    return Roles(**out)


def _paths(r: _Reader, raw, key: str) -> Paths:
    raw = r.mapping(raw, key, PATH_KEYS)
    caches_raw = r.mapping(raw.get("caches"), f"{key}.caches", CACHE_KEYS)
    caches = Caches(**{k: r.abspath(v, f"{key}.caches.{k}") for k, v in caches_raw.items()})
    values = {k: r.abspath(raw[k], f"{key}.{k}") for k in ("venv", "code", "runs", "model") if k in raw}
    for k, v in values.items():
        if v.rstrip("/") in ("", "/root", "/tmp", "/dev/shm", "/usr", "/etc") and k != "model":
            r.fail(f"{key}.{k}", f"refusing a system directory as the {k} directory: {v!r}")
    store = r.abspath(raw.get("model_store"), f"{key}.model_store", optional=True)
    if store is not None and store.rstrip("/") in ("", "/root", "/tmp", "/dev/shm", "/usr", "/etc"):
        r.fail(f"{key}.model_store", f"refusing a system directory as the model store: {store!r}")
    if store is not None and store.rstrip("/") == values.get("model", Paths.model).rstrip("/"):
        r.fail(f"{key}.model_store", "must differ from paths.model (it is the copy that survives a restart)")
    return Paths(**values, model_store=store, data=r.abspath(raw.get("data"), f"{key}.data", optional=True),
                 caches=caches)


def _container(r: _Reader, raw_id, raw, hosts: Mapping[str, Host]) -> Container:
    ctid = _ctid(r, raw_id, f"containers.{raw_id}")
    key = f"containers.{ctid}"
    raw = r.mapping(raw, key, CONTAINER_KEYS, required={"host"})
    host_name = r.text(raw["host"], f"{key}.host")
    if host_name not in hosts:
        r.fail(f"{key}.host", f"no host named {host_name!r} under hosts")
    secret_env = raw.get("secret_env", [])
    if not isinstance(secret_env, list) or not all(isinstance(s, str) and ENV_NAME.match(s)
                                                   for s in secret_env):
        r.fail(f"{key}.secret_env", "must be a list of environment variable names")
    tiny = raw.get("tiny_target", False)
    if not isinstance(tiny, bool):
        r.fail(f"{key}.tiny_target", f"must be true or false, got {tiny!r}")
    fit_steps = r.typed(raw.get("tiny_target_fit_steps", 0), f"{key}.tiny_target_fit_steps", int)
    if fit_steps < 0:
        r.fail(f"{key}.tiny_target_fit_steps", f"must be 0 or more, got {fit_steps}")
    package = raw.get("target_package")
    if package is not None and not (isinstance(package, str) and PACKAGE_NAME.match(package)):
        r.fail(f"{key}.target_package", f"must be a pip package name, got {package!r}")
    if package and tiny:
        r.fail(f"{key}.target_package", "and tiny_target: true ask for two targets; keep one")
    train_config = r.text(raw.get("train_config", "configs/production-27b.yaml"), f"{key}.train_config")
    if train_config.startswith("-"):
        r.fail(f"{key}.train_config", "must be a path, not an option")
    return Container(
        ctid=ctid,
        host=hosts[host_name],
        name=r.text(raw.get("name", ""), f"{key}.name"),
        roles=_roles(r, raw.get("roles"), f"{key}.roles"),
        python=r.abspath(raw.get("python", "/usr/bin/python3"), f"{key}.python"),
        tiny_target=tiny,
        tiny_target_fit_steps=fit_steps,
        target_package=package,
        paths=_paths(r, raw.get("paths"), f"{key}.paths"),
        train_config=train_config,
        env=r.env(raw.get("env"), f"{key}.env"),
        secret_env=tuple(secret_env),
        pip_env=r.env(raw.get("pip_env"), f"{key}.pip_env"),
        rdzv_address=_rdzv_address(r, raw.get("rdzv_address"), f"{key}.rdzv_address"),
    )


def parse_inventory(data, path: str = "<inventory>") -> Inventory:
    """Validate parsed YAML and build the inventory (pure: used by the loader and the unit tests)."""
    r = _Reader(path)
    base = Path(path).resolve().parent if path != "<inventory>" else Path.cwd()
    data = r.mapping(data, "", TOP_KEYS, required={"hosts", "containers"})
    hosts_raw = r.mapping(data["hosts"], "hosts")
    if not hosts_raw:
        r.fail("hosts", "at least one host is required")
    hosts = {name: _host(r, name, raw, base) for name, raw in hosts_raw.items()}
    for h in hosts.values():
        if h.jump is not None and (h.jump not in hosts or h.jump == h.name):
            r.fail(f"hosts.{h.name}.jump", f"no other host named {h.jump!r} under hosts")
    containers = {}
    for raw_id, raw in r.mapping(data["containers"], "containers").items():
        c = _container(r, raw_id, raw, hosts)
        if c.ctid in containers:
            r.fail(f"containers.{raw_id}", "container id listed twice")
        containers[c.ctid] = c
    groups = {}
    for name, members in r.mapping(data.get("groups"), "groups").items():
        if not isinstance(members, list) or not members:
            r.fail(f"groups.{name}", "must be a non-empty list of container ids")
        ids = tuple(_ctid(r, m, f"groups.{name}") for m in members)
        for i in ids:
            if i not in containers:
                r.fail(f"groups.{name}", f"container {i} is not defined under containers")
        groups[str(name)] = ids
    default = data.get("default_container")
    if default is not None:
        default = _ctid(r, default, "default_container")
        if default not in containers:
            r.fail("default_container", f"container {default} is not defined under containers")
    return Inventory(path=path, hosts=hosts, containers=containers, groups=groups, default_container=default)


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Read an inventory file; `None` means `$INVOKE_DFLASH_INVENTORY` or the production default."""
    path = str(path or os.environ.get("INVOKE_DFLASH_INVENTORY") or DEFAULT_INVENTORY)
    try:
        text = localfiles.read_regular(path, localfiles.INVENTORY_MAX, "inventory").decode("utf-8")
    except FileNotFoundError:
        hint = " (run `invoke sandbox.up` to create it)" if "sandbox" in Path(path).name else ""
        raise InventoryError(f"{path}: inventory file not found{hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"{path}: cannot read the inventory: {exc}") from None
    try:
        data = localfiles.load_yaml(text, path)  # duplicate keys and alias bombs refused
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise InventoryError(f"{path}: {where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:
        raise InventoryError(f"{path}: the YAML is nested too deeply") from None
    return parse_inventory(data, path)
