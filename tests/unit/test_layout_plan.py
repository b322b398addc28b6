"""`invoke plan`'s arithmetic (pure): candidate layouts from per-device figures, the best, the
fragment it writes, the argv it runs, and doctor's lagging-layout warning."""

import pytest
import yaml

from dflash_ops import doctor, plan
from dflash_ops.errors import UsageError
from dflash_ops.inventory import parse_inventory

# 27B-class on H200s, round numbers: one copy fits (42 GiB of 140), the target twice as fast
# per device as a drafter worker
H200_27B = plan.Measured(gpus=8, target_tok_s=18_000, drafter_tok_s=9_000, weights_gib=42.3,
                         activations_gib=1.0, device_gib=139.8)


def by_name(candidates):
    return {(c.target, c.placement): c for c in candidates}


def test_replicas_serve_the_drafters_in_rounds_and_split_runs_one_device_at_a_time():
    c = by_name(plan.layouts(H200_27B))
    assert len(c) == 13  # k = 1..7, split for k >= 2 (k = 1 is one placement)
    assert c[(5, "replicate")].target_side == 3 * 18_000  # 3 workers: 3 of 5 replicas busy
    assert c[(3, "replicate")].target_side == 18_000 * 5 / 2  # 5 workers on 3 replicas: 2 rounds
    assert c[(5, "split")].target_side == 18_000
    assert c[(5, "replicate")].drafter_side == 27_000
    assert c[(5, "replicate")].expected == 27_000 and c[(5, "replicate")].bound == "drafters"
    assert c[(5, "split")].expected == 18_000 and c[(5, "split")].bound == "target"


def test_the_best_layout_balances_the_two_sides():
    choice = plan.best(plan.layouts(H200_27B))
    # 3+5: target 18k x 5/2 = 45k, drafters 45k; 4+4 gives 36k, 5+3 27k
    assert (choice.target, choice.drafters, choice.placement) == (3, 5, "replicate")
    assert choice.expected == 45_000
    assert plan.hours_per_steps(choice, 20_000, 3072) == pytest.approx(20_000 * 5 * 3072 / 45_000 / 3600)


def test_a_target_that_does_not_fit_one_device_is_split():
    big = plan.Measured(gpus=4, target_tok_s=5_000, drafter_tok_s=9_000, weights_gib=250.0,
                        activations_gib=2.0, device_gib=139.8)
    c = by_name(plan.layouts(big))
    assert not c[(2, "replicate")].fits and c[(2, "replicate")].expected == 0
    assert c[(2, "split")].fits and not c[(1, "replicate")].fits
    assert (plan.best(plan.layouts(big)).target, plan.best(plan.layouts(big)).placement) == (2, "split")
    assert plan.configured(big, 2, "auto").placement == "split"
    assert plan.configured(H200_27B, 5, "auto").placement == "replicate"


def test_the_fragment_is_yaml_for_the_inventory_and_the_config(tmp_path):
    choice = plan.best(plan.layouts(H200_27B))
    text = plan.fragment(200, choice, H200_27B)
    assert text.startswith("# invoke plan for container 200: 3+5 replicate")
    assert yaml.safe_load(text) == {
        "containers": {200: {"roles": {"target": [0, 1, 2], "drafter": [3, 4, 5, 6, 7]}}},
        "train_config": {"target": {"placement": "replicate"}}}
    path = tmp_path / "layout.yaml"
    plan.write_fragment(str(path), 200, choice, H200_27B)
    assert path.read_text() == text
    with pytest.raises(UsageError, match="the file exists"):  # never over a file, an inventory least
        plan.write_fragment(str(path), 200, choice, H200_27B)


def test_doctor_warns_when_the_configured_layout_lags_the_best_by_more_than_30_percent():
    warning = plan.lagging(H200_27B, 5, "split")
    assert warning == ("configured 5+3 split expects 18,000 tok/s, 60% below 3+5 replicate "
                       "(45,000 tok/s)")
    assert plan.lagging(H200_27B, 4, "replicate") is None  # 36k: 20% below, within 30%
    record = {"kind": "plan", "gpus": 8, "target_tok_s": 18_000, "drafter_tok_s": 9_000,
              "weights_gib": 42.3, "activations_gib": 1.0, "device_gib": 139.8,
              "configured": {"target_devices": ["cuda:0"] * 5, "placement": "split"}}
    check = doctor.layout_check(record)
    assert check.ok and check.detail.startswith("WARNING: configured 5+3 split") \
        and "invoke plan" in check.fix
    assert doctor.layout_check(None).detail.startswith("not measured")
    assert doctor.layout_check(dict(record, configured={"target_devices": ["cuda:0"] * 3,
                                                        "placement": "auto"})).fix == ""


def test_plan_runs_the_payload_with_the_training_argv():
    inv = parse_inventory({"hosts": {"pve1": {"address": "pve1.example"}},
                           "containers": {200: {"host": "pve1",
                                                "roles": {"target": [0, 1], "drafter": [2]}}}},
                          "inv.yaml")
    argv = plan.plan_argv(inv.containers[200], sets=["train.batch_size=2"])
    assert argv[1].endswith("/plan_layout.py") and "--set=train.batch_size=2" in argv
    assert "--target-devices=cuda:0,cuda:1" in argv and "--drafter-devices=cuda:2" in argv
    assert argv[-1] == "--save=/root/runs/plan.json"
