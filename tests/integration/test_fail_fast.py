"""eval and regenerate check their paths in one round trip before the payload script starts (it
imports torch for 15-20 s before it reads its arguments): a wrong run, checkpoint, prompts file,
source or target is one line with train's preflight codes (6: run or checkpoint, 12: a path), and
the venv's Python never started."""

import pytest
from deployed_box import seeded_box

from dflash_ops.errors import ExitStatus

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def box(sandbox_factory, tmp_path_factory, template):
    b = seeded_box(sandbox_factory, tmp_path_factory, template)
    r = b.invoke("deploy")
    assert r.returncode == ExitStatus.OK, r.stderr
    b.sh("mkdir -p /root/runs/r1/checkpoints/step-2 && "
         "echo '{}' > /root/runs/r1/checkpoints/step-2/config.json")
    return b


@pytest.mark.parametrize("args, code, said", [
    (["eval", "--run", "nosuch"], ExitStatus.RUN_STATE, "no run 'nosuch' on pve1/200"),
    (["eval", "--run", "r1", "--checkpoint", "step-9"], ExitStatus.RUN_STATE,
     "run r1: no checkpoint 'step-9' on pve1/200"),
    (["eval", "--run", "r1", "--prompts", "/root/no.jsonl"], ExitStatus.PREFLIGHT,
     "--prompts /root/no.jsonl: no such file"),
    (["regenerate", "--target", "/root/nope"], ExitStatus.PREFLIGHT,
     "target /root/nope: no such directory or no config.json"),
    (["regenerate", "--src", "data/nope.jsonl"], ExitStatus.PREFLIGHT,
     "--src data/nope.jsonl: no such file or directory"),
])
def test_a_wrong_path_is_refused_before_the_script_starts(box, args, code, said):
    box.count_venv_starts()
    try:
        r = box.invoke(*args)
        starts = box.venv_starts()
    finally:
        box.stop_counting_venv_starts()
    assert (r.returncode, starts) == (code, 0), r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and said in r.stderr and r.stderr.count("\n") == 1, r.stderr
