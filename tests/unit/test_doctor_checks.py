"""doctor's verdicts on recorded container facts (remote/facts.py output from the embedded host)."""

import copy
import json

import pytest

from dflash_ops import deploy, doctor
from dflash_ops.inventory import parse_inventory

# Recorded from `facts` on the sandbox's container 200 after a deploy (file list shortened).
RECORDED = json.loads("""
{"hostname": "ct200",
 "code": {"exists": true, "link": true, "release": "/root/dflash.releases/7ab4f6442f146718",
          "files": {"train_config.py": "aa", "dflash_model.py": "bb"}, "tree": "TREE"},
 "venv": {"python": true, "requirements": "a057fe3009302e617550bf4f8707de1bb87dc9ce56a53fff859b8fd42751e916",
          "torch": {"rc": 0, "err": "",
                    "out": "{\\"torch\\": \\"2.13.0+cpu\\", \\"cuda\\": null, \\"available\\": false, \\"count\\": 0}"}},
 "model": {"dir": true, "config": true, "model_type": "qwen3", "text_model_type": "qwen3",
           "multimodal": false, "hidden_size": 64, "layers": 6},
 "gpus": {"smi": false},
 "space": {"shm": {"path": "/dev/shm", "free": 1072459776, "total": 1073741824},
           "runs": {"path": "/root/runs", "free": 82334191616, "total": 270553174016}},
 "caches": {"inductor": {"exists": true, "bytes": 300000, "files": 1, "path": "/root/.cache/dflash/inductor"},
            "torch_extensions": {"exists": false, "bytes": 0, "files": 0,
                                 "path": "/root/.cache/dflash/torch_extensions"},
            "triton": {"exists": false, "bytes": 0, "files": 0, "path": "/root/.cache/dflash/triton"}},
 "alive": null}
""")  # noqa: E501
HASHES = {"train_config.py": "aa", "dflash_model.py": "bb"}
REQ = "a057fe3009302e617550bf4f8707de1bb87dc9ce56a53fff859b8fd42751e916"
CPU = {"hosts": {"pve1": {"address": "127.0.0.1"}},
       "containers": {200: {"host": "pve1", "tiny_target": True,
                            "roles": {"target": ["cpu"], "drafter": ["cpu"]},
                            "paths": {"model": "/dev/shm/tiny-qwen3"}}}}
GPU = {"hosts": {"pve1": {"address": "pve1.example"}},
       "containers": {200: {"host": "pve1", "roles": {"target": [0, 1, 2, 3, 4], "drafter": [5, 6, 7]},
                            "paths": {"model": "/dev/shm/Qwen3.6-27B"}}}}


def recorded(**changes):
    found = copy.deepcopy(RECORDED)
    found["code"]["tree"] = deploy.tree_hash(HASHES)
    for path, value in changes.items():
        node = found
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return found


def verdicts(inv=CPU, **changes):
    ct = parse_inventory(inv).container(200)
    return {c.name: c for c in doctor.checks(ct, recorded(**changes), doctor.Local(HASHES, REQ))}


def test_recorded_healthy_sandbox_is_all_green():
    v = verdicts()
    assert all(c.ok for c in v.values()), [c for c in v.values() if not c.ok]
    assert v["model"].detail == "/dev/shm/tiny-qwen3: qwen3, hidden size 64, 6 layers"
    assert v["torch / CUDA"].detail.startswith("torch 2.13.0+cpu, CUDA none: 0 GPUs visible")
    assert v["compile caches"].detail == "inductor 293.0 KiB / 1 files; torch_extensions empty; triton empty"


@pytest.mark.parametrize("changes,name,detail,fix", [
    ({"model.dir": False, "model.config": False}, "model", "/dev/shm/tiny-qwen3 does not exist",
     "invoke deploy"),
    ({"model.config": False}, "model", "has no config.json", "invoke deploy"),
    ({"venv.requirements": "0" * 64}, "venv", "built from other requirements (000000000000", "invoke deploy"),
    ({"venv.python": False, "venv.torch": None}, "venv", "no python in /root/venv", "invoke deploy"),
    ({"venv.torch": {"rc": 1, "out": "", "err": "Traceback\nModuleNotFoundError: No module named 'torch'"}},
     "torch / CUDA", "torch does not import: ModuleNotFoundError: No module named 'torch'", "invoke deploy"),
    ({"code.files": {"train_config.py": "zz", "dflash_model.py": "bb"}}, "deployed code",
     "1 file(s) differ or are missing, 0 extra: train_config.py", "invoke deploy"),
    ({"code.exists": False}, "deployed code", "/root/dflash does not exist", "invoke deploy"),
    ({"space.shm.free": 10 << 20}, "free /dev/shm", "10.0 MiB free of 1.0 GiB", "free at least 256.0 MiB"),
])
def test_each_failure_names_what_is_wrong_and_the_fix(changes, name, detail, fix):
    v = verdicts(**changes)
    assert not v[name].ok and detail in v[name].detail and fix in v[name].fix
    also = {"venv": ["torch / CUDA"]}.get(name, []) if "venv.python" in changes else []
    assert sorted(n for n, c in v.items() if not c.ok) == sorted([name, *also])


def test_multimodal_config_is_reported_by_its_text_config():
    v = verdicts(inv=GPU, **{"model.model_type": "qwen3_5_moe", "model.multimodal": True,
                             "model.text_model_type": "qwen3_5_moe_text", "model.hidden_size": 5120,
                             "model.layers": 64})
    assert v["model"].ok and v["model"].detail == ("/dev/shm/Qwen3.6-27B: qwen3_5_moe -> text config "
                                                  "qwen3_5_moe_text, hidden size 5120, 64 layers")


def test_gpus_against_the_roles():
    eight = [[str(i), "NVIDIA H200", "143771 MiB", "570.86.15"] for i in range(8)]
    ok = verdicts(inv=GPU, **{"gpus": {"smi": True, "rc": 0, "err": "", "gpus": eight}})["GPUs (nvidia-smi)"]
    assert ok.ok and ok.detail == "8 visible (NVIDIA H200; driver 570.86.15), the roles need 8"
    short = verdicts(inv=GPU,
                     **{"gpus": {"smi": True, "rc": 0, "err": "", "gpus": eight[:7]}})["GPUs (nvidia-smi)"]
    assert not short.ok and "the roles need 8" in short.detail and "lxc.mount.entry" in short.fix
    mismatch = verdicts(inv=GPU, **{"gpus": {"smi": True, "rc": 18, "gpus": [],
                                             "err": "Failed to initialize NVML: Driver/library "
                                                    "version mismatch"}})
    assert not mismatch["GPUs (nvidia-smi)"].ok and "version mismatch" in mismatch["GPUs (nvidia-smi)"].detail
    assert not verdicts(inv=GPU)["GPUs (nvidia-smi)"].ok  # no nvidia-smi while the roles name GPUs
    torch_short = verdicts(inv=GPU)["torch / CUDA"]  # the recorded CPU torch sees 0 of the 8 GPUs
    assert not torch_short.ok and "0 GPU(s) visible, the roles need 8" in torch_short.detail


def test_an_alive_run_is_reported():
    assert verdicts(alive="run-7")["runs"].detail == "run 'run-7' is alive"


def test_a_full_dev_shm_is_not_blamed_on_old_runs():
    from dflash_ops.doctor import space_check

    shm = space_check("free /dev/shm", {"free": 0, "total": 1 << 30, "path": "/dev/shm"}, 256 << 20)
    runs = space_check("free runs dir", {"free": 0, "total": 1 << 30, "path": "/root/runs"}, 1 << 30)
    assert not shm.ok and "/dev/shm" in shm.fix and "old runs" not in shm.fix
    assert not runs.ok and "old runs" in runs.fix


def test_the_containers_memory_limit_is_shown_and_its_oom_kills_warned():
    assert doctor.memory_check({"limit": 4096 << 20, "oom_kills": 0}) == doctor.Check(
        "container memory", True, "4096 MiB limit")
    warned = doctor.memory_check({"limit": 256 << 20, "oom_kills": 2})
    assert (warned.ok, warned.fix) == (True, "docs/runbooks/container-oom.md")
    assert warned.detail.startswith("WARNING: 256 MiB limit; its OOM killer killed 2 process(es)")
    assert doctor.memory_check({}).detail == "no limit found"


def test_a_gone_target_names_invoke_stage_when_the_inventory_has_a_store():
    """After a restart /dev/shm is empty: the fix is the command that puts the target back."""
    with_store = copy.deepcopy(GPU)
    with_store["containers"][200]["paths"]["model_store"] = "/root/models/Qwen3.6-27B"
    gone = {"model.dir": False, "model.config": False}
    assert "invoke stage --ct 200" in verdicts(inv=with_store, **gone)["model"].fix
    assert "/root/models/Qwen3.6-27B" in verdicts(inv=with_store, **gone)["model"].fix
    assert "paths.model_store and run `invoke stage`" in verdicts(inv=GPU, **gone)["model"].fix
