"""The venv's recorded torch check (remote/facts.py venv_fact): reused only while the requirements stamp
and the GPU set are the same; "always" (doctor) imports torch every time. The venv's python here is a
script that counts its starts and answers as the torch check does."""

import json
import os
import stat

import pytest

from dflash_ops.remote import facts as container_facts

ANSWER = json.dumps({"torch": "2.13.0+cpu", "cuda": None, "available": False, "count": 0})


@pytest.fixture
def venv(tmp_path):
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho x >> {tmp_path}/starts\n[ -e {tmp_path}/broken ] && exit 1\necho "
                      f"'{ANSWER}'\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    (tmp_path / container_facts.REQUIREMENTS_STAMP).write_text("req-1\n")
    return tmp_path


def starts(venv) -> int:
    path = venv / "starts"
    return len(path.read_text().split()) if path.exists() else 0


def fact(venv, env=None, check="recorded"):
    return container_facts.venv_fact(str(venv), dict(env or {}), check)


def test_a_passing_check_is_reused_while_requirements_and_gpus_stay_the_same(venv):
    first = fact(venv)
    assert first["torch"]["rc"] == 0 and "recorded" not in first["torch"] and starts(venv) == 1
    again = fact(venv)
    assert again["torch"] == {**first["torch"], "recorded": True} and starts(venv) == 1


@pytest.mark.parametrize("change", ["requirements", "visible", "always"])
def test_new_requirements_another_gpu_set_or_always_run_it_again(venv, change):
    fact(venv)
    if change == "requirements":
        (venv / container_facts.REQUIREMENTS_STAMP).write_text("req-2\n")
    env = {"CUDA_VISIBLE_DEVICES": "1"} if change == "visible" else {}
    assert "recorded" not in fact(venv, env, "always" if change == "always" else "recorded")["torch"]
    assert starts(venv) == 2
    assert fact(venv, env)["torch"]["recorded"] and starts(venv) == 2  # the new check is the record now


def test_a_failing_check_is_never_reused(venv):
    fact(venv)
    (venv / "broken").touch()
    assert fact(venv, check="always")["torch"]["rc"] == 1
    assert not os.path.exists(venv / container_facts.TORCH_RECORD)
    assert fact(venv)["torch"]["rc"] == 1 and starts(venv) == 3
