"""invoke doctor against the embedded host: all green on a deployed container, the
right red line otherwise."""

import pytest
from deployed_box import seeded_box

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration
CHECKS = ("host reachable", "container running", "GPUs (nvidia-smi)", "torch / CUDA", "venv", "deployed code",
          "model", "free /dev/shm", "free runs dir", "compile caches", "runs")


@pytest.fixture(scope="module")
def box(sandbox_factory, tmp_path_factory, template):
    return seeded_box(sandbox_factory, tmp_path_factory, template)


def rows(output: str) -> dict:
    """check name -> (mark, the rest of its table row), from the rendered table."""
    out = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) >= 3 and cells[1] in CHECKS:
            out[cells[1]] = (cells[0], " ".join(cells[2:]))
    return out


def test_healthy_container_passes_every_check_in_one_round_trip(box):
    box.count_venv_starts()
    try:
        r = box.invoke("doctor", env={"DFLASH_OPS_STATS": "1"})
        again = box.invoke("doctor")
        starts = box.venv_starts()
    finally:
        box.stop_counting_venv_starts()
    assert again.returncode == ExitStatus.OK
    assert starts == 2  # torch imported by each doctor: never a recorded check
    assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
    found = rows(r.stdout)
    assert set(found) == set(CHECKS)
    assert all(mark == "ok" for mark, _ in found.values()), r.stdout
    assert "torch 2.13.0" in found["torch / CUDA"][1] and "0 GPUs visible" in found["torch / CUDA"][1]
    assert "qwen3, hidden size" in found["model"][1]
    assert "= local tree" in found["deployed code"][1]
    assert "ssh stats: pve1: 1 connection(s), 1 round trip(s)" in r.stderr


def test_missing_model_dir_fails_with_the_fix(box):
    box.sh("mv /dev/shm/tiny-qwen3 /dev/shm/tiny-qwen3.away")
    try:
        r = box.invoke("doctor")
    finally:
        box.sh("mv /dev/shm/tiny-qwen3.away /dev/shm/tiny-qwen3")
    assert r.returncode == ExitStatus.CHECK_FAILED
    found = rows(r.stdout)
    mark, text = found["model"]
    assert mark == "FAIL" and "/dev/shm/tiny-qwen3 does not exist" in text and "invoke deploy" in text
    assert all(m == "ok" for name, (m, _) in found.items() if name != "model")
    assert "error: doctor: 1 check(s) failed on pve1/200: model" in r.stderr


def test_code_edited_in_the_container_and_a_stopped_container_are_reported(box):
    box.sh("echo '# edited in the container' >> /root/dflash/train_config.py")
    try:
        r = box.invoke("doctor")
    finally:
        box.invoke("deploy")
    assert r.returncode == ExitStatus.CHECK_FAILED
    mark, text = rows(r.stdout)["deployed code"]
    assert mark == "FAIL" and "train_config.py" in text and "invoke deploy" in text
    stopped = box.invoke("doctor", ct="201")
    assert stopped.returncode == ExitStatus.CHECK_FAILED
    mark, text = rows(stopped.stdout)["container running"]
    assert mark == "FAIL" and "pct start 201" in text
