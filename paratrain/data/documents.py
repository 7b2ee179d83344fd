"""A corpus of documents on local disk: ``.jsonl`` / ``.parquet`` files (one document a record, its text in a
named field) and ``.txt`` files (one document a file), read through the ``datasets`` library.

``document_files`` lists a corpus's files; ``document_problems`` checks them before any process starts (a broken
jsonl line, a missing text field, an empty corpus), naming the file and line; ``read_documents`` returns the texts.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

# file suffix -> the datasets builder that reads it; documents come in this order of formats, each's files by name
FORMATS = {".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


def document_files(path: Path, formats: dict[str, str] = FORMATS) -> list[Path]:
    """The corpus files of ``path`` (a file, or a folder searched recursively) with a suffix of ``formats``, sorted
    by format then name."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    files = [p for p in files if p.suffix in formats]
    return sorted(files, key=lambda p: (list(formats).index(p.suffix), str(p)))


def document_problems(path: Path, text_field: str, key: str = "data.path") -> list[str]:
    """Every problem with the corpus at ``path`` (``key``, ``data.path`` or ``data.eval_path``, of ``data.kind =
    "documents"``): each names the file and line (or column) and a fix. Reads every jsonl line and each parquet
    file's schema once."""

    def file_problem(file: Path) -> tuple[int, str | None]:
        if file.suffix == ".jsonl":
            return _jsonl_problem(file, text_field)
        if file.suffix == ".parquet":
            return _parquet_problem(file, text_field)
        return int(file.stat().st_size > 0), None

    return corpus_problems(path, FORMATS, file_problem, "document", key)


def corpus_problems(path: Path, formats: dict[str, str], file_problem, record: str,
                    key: str = "data.path") -> list[str]:
    """Every problem with the corpus at ``path`` (the setting ``key``) of files with the suffixes of ``formats``: a
    missing path, no such file, each file's first problem by ``file_problem(file)`` -> (records it holds, problem or
    None), no ``record`` (what one is called) in any of them."""
    suffixes = " / ".join(formats)
    if not path.exists():
        return [f"{key}={path} does not exist: give a folder or a file of {suffixes} {record}s"]
    if path.is_file() and path.suffix not in formats:
        return [f"{key}={path} is a {path.suffix or 'suffix-less'} file: give {suffixes} {record}s (or a "
                f"folder of them)"]
    files = document_files(path, formats)
    if not files:
        return [f"{key}={path} holds no {suffixes} file: put the {record}s there"]
    problems, records = [], 0
    for file in files:
        found, problem = file_problem(file)
        records += found
        if problem:
            problems.append(problem)
    if not problems and not records:
        problems.append(f"{key}={path}: its {len(files)} files hold no {record}: add {record}s to them")
    return problems


def _jsonl_problem(file: Path, text_field: str) -> tuple[int, str | None]:
    """(documents in a jsonl file, its first problem or None)."""

    def problem(record) -> str | None:
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
            return f"has no field {text_field!r} (it holds {keys}): set data.text_field to the field holding the text"
        if not isinstance(record[text_field], str):
            return (f"has a field {text_field!r} that is a {type(record[text_field]).__name__}, not a string: store "
                    f"the text there")
        return None

    return jsonl_problem(file, problem)


def jsonl_problem(file: Path, record_problem) -> tuple[int, str | None]:
    """(records of a jsonl file up to its first problem, that problem or None): a line that is not JSON, or one
    whose record ``record_problem(record)`` finds wrong (it returns the rest of a sentence starting "FILE line N",
    saying what is wrong and the fix, or None); blank lines are skipped."""
    records = 0
    try:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    return records, (f"{file} line {number} is not JSON ({exc}): fix or remove that line "
                                     f"(one JSON object a line)")
                if (problem := record_problem(record)) is not None:
                    return records, f"{file} line {number} {problem}"
                records += 1
    except UnicodeDecodeError as exc:
        return records, f"{file} is not UTF-8 text (byte {exc.object[exc.start]:#04x}): convert it to UTF-8"
    return records, None


def _parquet_problem(file: Path, text_field: str) -> tuple[int, str | None]:
    """(rows of a parquet file, a problem or None)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(file)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid (and OSError) for a file it cannot parse
        return 0, f"{file} is not a parquet file ({exc}): write it with datasets' to_parquet or pyarrow"
    columns = meta.schema.to_arrow_schema().names
    if text_field not in columns:
        return 0, (f"{file} has no column {text_field!r} (it has {', '.join(map(repr, columns))}): set "
                   f"data.text_field to the column holding the text")
    return meta.num_rows, None


def read_documents(path: Path, text_field: str) -> list[str]:
    """The texts of the corpus at ``path``, in ``document_files`` order (a ``.txt`` file is one document)."""
    texts: list[str] = []
    for builder, dataset in load_records(document_files(path)):
        texts += [t for t in dataset["text" if builder == "text" else text_field] if t]
    return texts


def load_records(files: list[Path]):
    """(builder, ``datasets.Dataset``) of each format of ``files`` (``document_files`` order), loaded with
    ``datasets.load_dataset`` from the local files (its cache in a temporary folder, removed after)."""
    from datasets import load_dataset

    with tempfile.TemporaryDirectory(prefix="paratrain-documents-") as cache:
        for suffix, builder in FORMATS.items():
            group = [str(f) for f in files if f.suffix == suffix]
            if group:
                options = {"sample_by": "document"} if builder == "text" else {}
                yield builder, load_dataset(builder, data_files=group, split="train", cache_dir=cache, **options)
