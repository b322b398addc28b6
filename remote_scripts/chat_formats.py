"""Chat datasets as people export them -> rows of turns `[{"role", "content"}]`.

Row formats, detected per file from its first readable row and reported:
- `dflash` (ours): `{"id", "conversations": [{"role", "content"}]}`
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system", "value"}]}`
- `openai`: `{"messages": [{"role": "system"|"user"|"assistant", "content"}]}` (content may be
  a list of `{"type": "text", "text"}` parts)
Files: `.jsonl`, `.jsonl.gz`, `.json` (an array of rows), `.parquet` (needs pyarrow), or a
directory of such shards (read in name order). System prompts and multi-turn conversations keep
their turns. A malformed row (not JSON, unknown role, no assistant turn, over MAX_ROW_BYTES, nested
deeper than MAX_DEPTH) is counted and skipped; its number and reason are kept for the report, and more than
`max_bad_fraction` of bad rows is one DataError. Stdlib only (pyarrow only for Parquet), so the
preflight reads data without torch.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from dataclasses import dataclass, field

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "chatgpt": "assistant", "model": "assistant", "system": "system"}
SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".json": "json", ".parquet": "parquet"}
MAX_ROW_BYTES = 1 << 20  # far beyond any max_length; a bigger row is a broken export
MAX_DEPTH = 32  # a chat row nests 5 deep; JSON's own parser gives up (RecursionError) near 1000
SHOWN_BAD_ROWS = 3
DEEP = f"nested deeper than {MAX_DEPTH} levels"


class DataError(ValueError):
    """Unreadable or unusable data; the message is one line."""


class BadRow(ValueError):
    """One row that cannot be used (the reason is the message)."""


@dataclass
class Row:
    id: str
    turns: list[dict]


@dataclass
class FileReport:
    path: str
    container: str
    format: str = "?"
    rows: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)  # (row number, reason)

    def describe(self) -> str:
        line = f"{shown(self.path)}: {self.format} rows in {self.container}, {self.rows} read"
        if self.bad:
            first = "; ".join(f"row {n}: {why}" for n, why in self.bad[:SHOWN_BAD_ROWS])
            line += f", {len(self.bad)} skipped ({first}{'; ...' if len(self.bad) > SHOWN_BAD_ROWS else ''})"
        return line


# ----------------------------------------------------------------------------- files

def shown(path: str) -> str:
    """A file name as one line of a report: a line break or control character in it is escaped (a
    shard named "x\\nRESULT {" must not print a line of its own)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in path)


def too_deep(value, limit: int = MAX_DEPTH) -> bool:
    """Whether lists and objects nest deeper than `limit` in `value` (iterative: any depth)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def container_of(path: str) -> str:
    for suffix, name in sorted(SUFFIXES.items(), key=lambda item: -len(item[0])):
        if path.endswith(suffix):
            return name
    raise DataError(f"{shown(path)}: unknown file type (expected {', '.join(SUFFIXES)} or a directory "
                    f"of them)")


def data_files(path: str) -> list[str]:
    """The file itself, or a directory's shards (known suffixes, name order)."""
    if os.path.isdir(path):
        shards = sorted(os.path.join(path, name) for name in os.listdir(path)
                        if not name.startswith(".") and any(name.endswith(s) for s in SUFFIXES))
        if not shards:
            raise DataError(f"{shown(path)}: a directory without data shards ({', '.join(SUFFIXES)})")
        return shards
    if not os.path.exists(path):
        raise DataError(f"data file not found: {shown(path)}")
    container_of(path)
    if not os.access(path, os.R_OK):
        raise DataError(f"{shown(path)}: not readable (permissions)")
    if os.path.getsize(path) == 0:
        raise DataError(f"{shown(path)}: empty file")
    return [path]


def _jsonl_lines(stream, path: str):
    """(row number, bytes) per non-blank line; a line over the limit is not read into memory."""
    number = 0
    while True:
        line = stream.readline(MAX_ROW_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_ROW_BYTES and not line.endswith(b"\n"):
            size = len(line)
            while line and not line.endswith(b"\n"):  # skip the rest of the oversized line
                line = stream.readline(MAX_ROW_BYTES)
                size += len(line)
            yield number, BadRow(f"row is {size / 1e6:.1f} MB, over the "
                                 f"{MAX_ROW_BYTES >> 20} MB row limit")
        elif line.strip():
            yield number, line


def _records(path: str, container: str):
    """(row number, dict | BadRow) for every row of one file."""
    if container == "parquet":
        yield from _parquet_records(path)
        return
    if container == "json":
        try:
            with open(path, "rb") as f:
                rows = json.loads(f.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise DataError(f"{shown(path)}: not a JSON file ({_first_line(exc)})") from None
        except RecursionError:
            raise DataError(f"{shown(path)}: not a JSON file (nested too deep to read)") from None
        if not isinstance(rows, list):
            raise DataError(f"{shown(path)}: a .json dataset must be an array of rows, not "
                            f"{type(rows).__name__}")
        for number, row in enumerate(rows, 1):
            if too_deep(row):
                yield number, BadRow(DEEP)
                continue
            too_big = len(json.dumps(row)) > MAX_ROW_BYTES
            yield number, BadRow(f"row over the {MAX_ROW_BYTES >> 20} MB row limit") if too_big else row
        return
    opener = gzip.open if container == "jsonl.gz" else open
    try:
        with opener(path, "rb") as f:
            for number, line in _jsonl_lines(f, path):
                if isinstance(line, BadRow):
                    yield number, line
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, UnicodeDecodeError) as exc:
                    yield number, BadRow(f"not JSON ({_first_line(exc)[:60]})")
                    continue
                except RecursionError:  # deeper than JSON's own parser goes
                    yield number, BadRow(DEEP)
                    continue
                yield number, BadRow(DEEP) if too_deep(record) else record
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{shown(path)}: cannot read {container} ({_first_line(exc)})") from None


PARQUET_BATCH = 1024  # rows read at once (their strings as dictionaries: indices, and each value once)
BATCH_TEXT_MAX = 64 << 20  # a batch's text made at once; beyond it, row by row
EXPANSION_MAX, EXPANSION_FLOOR = 1000, 64 << 20  # a file's rows may hold this many times its size


def _parquet_records(path: str):
    """Rows of a Parquet file, never more text decoded than its rows may hold. A few bytes of Parquet can
    expand to GiB (one long string in a dictionary page that every row points to, or one compressed
    page): a row group whose pages hold more than its rows may is skipped undecoded; strings are read
    as dictionaries, each row's expanded size is summed from the dictionary's lengths, and a row over
    MAX_ROW_BYTES is skipped before its text is made. Rows holding more than EXPANSION_MAX times the
    file's size (at least EXPANSION_FLOOR) in all are a DataError: many rows each under the limit."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{shown(path)}: reading Parquet needs the pyarrow package "
                        f"(pip install pyarrow in the training venv)") from None
    try:
        handle = pq.ParquetFile(path)
        columns = handle.schema_arrow.names
        if not {"conversations", "messages"} & set(columns):
            raise DataError(f"{shown(path)}: Parquet columns {columns}: a chat dataset needs a "
                            f"'conversations' or 'messages' column")
        dense = handle.schema_arrow
        texts = [c.path for c in handle.schema if c.physical_type == "BYTE_ARRAY"]
        handle = pq.ParquetFile(path, read_dictionary=texts)
        allowed, total, number = max(EXPANSION_MAX * os.path.getsize(path), EXPANSION_FLOOR), 0, 0
        for group in range(handle.metadata.num_row_groups):
            meta = handle.metadata.row_group(group)
            pages = sum(meta.column(i).total_uncompressed_size for i in range(meta.num_columns))
            if pages > meta.num_rows * MAX_ROW_BYTES:
                for _ in range(meta.num_rows):
                    number += 1
                    yield number, BadRow(f"its row group holds {pages / 1e6:.1f} MB for {meta.num_rows} "
                                         f"row(s), over the {MAX_ROW_BYTES >> 20} MB row limit")
                continue
            for batch in handle.iter_batches(batch_size=PARQUET_BATCH, row_groups=[group]):
                sizes = [0] * batch.num_rows
                for column in batch.columns:
                    sizes = [a + b for a, b in zip(sizes, _expanded(column).to_pylist(), strict=True)]
                total += sum(size for size in sizes if size <= MAX_ROW_BYTES)
                if total > allowed:
                    raise DataError(f"{shown(path)}: its rows expand to more than {allowed / 1e6:.0f} MB, "
                                    f"{EXPANSION_MAX} times its {os.path.getsize(path)} bytes: refusing it")
                if sum(sizes) <= BATCH_TEXT_MAX and max(sizes) <= MAX_ROW_BYTES:
                    records = _made(batch, dense).to_pylist()
                else:  # only the rows that fit are made
                    records = [_made(batch.slice(i, 1), dense).to_pylist()[0] if size <= MAX_ROW_BYTES
                               else None for i, size in enumerate(sizes)]
                for size, record in zip(sizes, records, strict=True):
                    number += 1
                    if record is None:
                        yield number, BadRow(f"row expands to {size / 1e6:.1f} MB, over the "
                                             f"{MAX_ROW_BYTES >> 20} MB row limit")
                    else:
                        yield number, BadRow(DEEP) if too_deep(record) else record
    except DataError:
        raise
    except Exception as exc:  # pyarrow's ArrowInvalid/ArrowIOError and friends
        raise DataError(f"{shown(path)}: not a readable Parquet file ({_first_line(exc)})") from None


def _made(batch, dense):
    """The batch with its strings made (its dictionaries decoded), in the file's own schema."""
    import pyarrow as pa

    return pa.RecordBatch.from_arrays([batch.column(i).cast(dense.field(name).type)
                                       for i, name in enumerate(batch.schema.names)], schema=dense)


def _expanded(array):
    """Per element of an Arrow array, the bytes of text (and 8 per other value) it holds once decoded,
    computed from lengths and offsets: a dictionary's values are measured once, never made per row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):
        lengths = _text_lengths(array.dictionary)
        if lengths is None:
            return pa.array([8] * len(array), pa.int64())
        return pc.coalesce(lengths.take(array.indices), 0)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        inner = pc.cumulative_sum(_expanded(array.flatten()))
        ends = pa.concat_arrays([pa.array([0], pa.int64()), inner.cast(pa.int64())])
        offsets = pc.subtract(array.offsets.cast(pa.int64()), array.offsets[0].cast(pa.int64()))
        sums = pc.subtract(ends.take(offsets[1:]), ends.take(offsets[:-1]))
        return pc.add(sums, 8)
    if pa.types.is_struct(kind):
        total = pa.array([0] * len(array), pa.int64())
        for field in array.flatten():
            total = pc.add(total, _expanded(field))
        return total
    lengths = _text_lengths(array)
    return pa.array([8] * len(array), pa.int64()) if lengths is None else pc.coalesce(lengths, 0)


def _text_lengths(array):
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)):
        return pc.binary_length(array).cast(pa.int64())
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# ----------------------------------------------------------------------------- rows

def detect_format(record) -> str | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("messages"), list):
        return "openai"
    turns = record.get("conversations")
    if isinstance(turns, list) and turns and isinstance(turns[0], dict):
        return "sharegpt" if "from" in turns[0] else "dflash"
    return None


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise BadRow(f"content is {type(content).__name__}, not text")


def turns_of(record, fmt: str) -> list[dict]:
    """One row in format `fmt` -> [{"role": system|user|assistant, "content": str}]."""
    if not isinstance(record, dict):
        raise BadRow(f"a {type(record).__name__}, not an object")
    key, role_key, content_key = (("messages", "role", "content") if fmt == "openai" else
                                  ("conversations", "from", "value") if fmt == "sharegpt" else
                                  ("conversations", "role", "content"))
    raw = record.get(key)
    if not isinstance(raw, list) or not raw:
        raise BadRow(f"no '{key}' list ({fmt} file)")
    turns = []
    for index, turn in enumerate(raw, 1):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {index} is not an object")
        if role_key not in turn or content_key not in turn:
            raise BadRow(f"turn {index}: no '{role_key}' and '{content_key}' ({fmt} rows)")
        role = ROLE_NAMES.get(turn[role_key])
        if role is None:
            raise BadRow(f"turn {index}: unknown {role_key} {str(turn.get(role_key))[:20]!r}")
        try:
            content = _text(turn.get(content_key))
        except BadRow as exc:
            raise BadRow(f"turn {index}: {exc}") from None
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" for t in turns):
        raise BadRow("no assistant turn")
    return turns


def read_file(path: str, limit: int | None = None) -> tuple[list[Row], FileReport]:
    container = container_of(path)
    report = FileReport(path, container)
    rows, fmt = [], None
    stem = os.path.basename(path).split(".")[0]
    for number, record in _records(path, container):
        if limit is not None and len(rows) >= limit:
            break
        try:
            if isinstance(record, BadRow):
                raise record
            fmt = fmt or detect_format(record)
            if fmt is None:
                raise BadRow("not a chat row (no 'conversations' or 'messages' list)")
            turns = turns_of(record, fmt)
        except BadRow as exc:
            report.bad.append((number, str(exc)))
            continue
        row_id = record.get("id")
        rows.append(Row(str(row_id) if row_id is not None else f"{stem}-{number}", turns))
    report.format, report.rows = fmt or "?", len(rows) + len(report.bad)
    return rows, report


def read_dataset(path: str, max_bad_fraction: float = 0.05, limit: int | None = None,
                 log=None) -> list[Row]:
    """Every usable row of a file or a directory of shards; one report line per file to `log`.

    More than max_bad_fraction of the rows unusable (or none usable) is a DataError."""
    rows, reports = [], []
    for shard in data_files(path):
        found, report = read_file(shard, None if limit is None else limit - len(rows))
        rows += found
        reports.append(report)
        if log:
            log(report.describe())
        if limit is not None and len(rows) >= limit:
            break
    total = sum(r.rows for r in reports)
    bad = [(r.path, n, why) for r in reports for n, why in r.bad]
    if not rows or len(bad) > max_bad_fraction * total:
        first = "; ".join(f"{shown(os.path.basename(p))} row {n}: {why}"
                          for p, n, why in bad[:SHOWN_BAD_ROWS])
        raise DataError(f"{shown(path)}: {len(bad)} of {total} rows unusable, over the "
                        f"{max_bad_fraction:.0%} limit (data.max_bad_fraction) ({first or 'no rows'})")
    return rows


# ----------------------------------------------------------------------------- prompts

def prompt_key(turns: list[dict]) -> str:
    """A hash of the prompt (the turns before the first assistant turn), case and spacing
    normalised: the same question asked twice is the same key."""
    prompt = []
    for turn in turns:
        if turn["role"] == "assistant":
            break
        prompt.append(f"{turn['role']}:{' '.join(turn['content'].lower().split())}")
    return hashlib.sha256("\n".join(prompt).encode()).hexdigest()[:24]


def prompt_overlap(train: list[Row], heldout: list[Row]) -> tuple[int, int]:
    """(held-out rows whose prompt also appears in train, held-out rows)."""
    seen = {prompt_key(r.turns) for r in train}
    return sum(prompt_key(r.turns) in seen for r in heldout), len(heldout)
