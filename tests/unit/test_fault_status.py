"""`status` on a run whose disk filled up: the log may end mid-line with no error in it and the
wrapper may have had no room for the exit code, so the free space it reads names the runbook."""

from recorded_answers import status_answer

from dflash_ops.status import parse_status

FULL_DISK_FACTS = """now 1764421000
name tear
exists 1
alive 0
pid 67
pgid 60
started 1764420900
mtime_log 1764420990
free {free}
metric {{"kind": "train", "step": 91, "loss": 3.1}}
metric {{"kind": "train", "step": 92, "loss": 2.9, "acceptance_len
log 13:24:15 INFO step 92/300 | loss 2.9011 | tau 1.43 | acc[1:5] 0.3
end
"""


def test_a_full_run_filesystem_is_named_even_without_an_error_line():
    st = parse_status(status_answer(FULL_DISK_FACTS.format(free=0)))
    assert (st.state, st.step) == ("crashed", 91)  # the torn last record is skipped
    assert st.detail.startswith("no exit code recorded")
    assert [(f["key"], f["runbook"]) for f in st.findings] == [("disk-full", "docs/runbooks/disk-full.md")]
    assert st.findings[0]["line"] == "0 bytes free on the run directory's filesystem"


def test_enough_space_or_no_fact_adds_nothing():
    assert parse_status(status_answer(FULL_DISK_FACTS.format(free=5 << 30))).findings == []
    assert parse_status(status_answer(FULL_DISK_FACTS.replace("free {free}\n", ""))).findings == []
