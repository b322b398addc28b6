"""How streamed remote output is cut into lines and kept: terminal.LineSink and mux.OutputTail."""

from dflash_ops import mux, terminal


class Lines(terminal.LineSink):
    def __init__(self):
        self.got = []

    def line(self, line):
        self.got.append(line)


def test_lines_are_whole_whatever_the_reads_cut():
    text = "first\r\nsecond é\r\n" + "x" * 100_000 + "\nlast, no newline"
    for size in (1, 7, 1000, len(text)):
        sink = Lines()
        for i in range(0, len(text), size):
            sink.write(text[i:i + size])
        sink.close()
        assert sink.got == ["first", "second é", "x" * 100_000, "last, no newline"], size
        sink.close()
        assert len(sink.got) == 4  # nothing left to hand on twice


def test_a_streamed_result_keeps_the_last_mebibyte_only():
    tail = mux.OutputTail()
    chunks = [f"{i:07d}\n" for i in range(600_000)]  # 4.8 MB
    for chunk in chunks:
        tail.append(chunk)
    kept = "".join(tail)
    whole = "".join(chunks)
    assert whole.endswith(kept) and mux.STREAMED_TAIL <= len(kept) <= 2 * mux.STREAMED_TAIL
    assert tail.size == len(kept)
