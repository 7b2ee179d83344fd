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


def document_files(path: Path) -> list[Path]:
    """The corpus files of ``path`` (a file, or a folder searched recursively), sorted by format then name."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    files = [p for p in files if p.suffix in FORMATS]
    return sorted(files, key=lambda p: (list(FORMATS).index(p.suffix), str(p)))


def document_problems(path: Path, text_field: str, key: str = "data.path") -> list[str]:
    """Every problem with the corpus at ``path`` (``key``, ``data.path`` or ``data.eval_path``, of ``data.kind =
    "documents"``): each names the file and line (or column) and a fix. Reads every jsonl line and each parquet
    file's schema once."""
    if not path.exists():
        return [f"{key}={path} does not exist: give a folder or a file of .jsonl / .parquet / .txt documents"]
    if path.is_file() and path.suffix not in FORMATS:
        return [f"{key}={path} is a {path.suffix or 'suffix-less'} file: give .jsonl, .parquet or .txt documents "
                f"(or a folder of them)"]
    files = document_files(path)
    if not files:
        return [f"{key}={path} holds no .jsonl, .parquet or .txt file: put the documents there"]
    problems, documents = [], 0
    for file in files:
        if file.suffix == ".jsonl":
            found, problem = _jsonl_problem(file, text_field)
        elif file.suffix == ".parquet":
            found, problem = _parquet_problem(file, text_field)
        else:
            found, problem = int(file.stat().st_size > 0), None
        documents += found
        if problem:
            problems.append(problem)
    if not problems and not documents:
        problems.append(f"{key}={path}: its {len(files)} files hold no document: add text to them")
    return problems


def _jsonl_problem(file: Path, text_field: str) -> tuple[int, str | None]:
    """(documents in a jsonl file, its first problem or None)."""
    documents = 0
    try:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    return documents, (f"{file} line {number} is not JSON ({exc}): fix or remove that line "
                                       f"(one JSON object a line)")
                if not isinstance(record, dict) or text_field not in record:
                    keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                    return documents, (f"{file} line {number} has no field {text_field!r} (it holds {keys}): set "
                                       f"data.text_field to the field holding the text")
                if not isinstance(record[text_field], str):
                    return documents, (f"{file} line {number}: field {text_field!r} is a "
                                       f"{type(record[text_field]).__name__}, not a string: store the text there")
                documents += 1
    except UnicodeDecodeError as exc:
        return documents, f"{file} is not UTF-8 text (byte {exc.object[exc.start]:#04x}): convert it to UTF-8"
    return documents, None


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
    """The texts of the corpus at ``path``, in ``document_files`` order (a ``.txt`` file is one document), loaded
    with ``datasets.load_dataset`` from the local files (its cache in a temporary folder, removed after)."""
    from datasets import load_dataset

    files = document_files(path)
    texts: list[str] = []
    with tempfile.TemporaryDirectory(prefix="paratrain-documents-") as cache:
        for suffix, builder in FORMATS.items():
            group = [str(f) for f in files if f.suffix == suffix]
            if not group:
                continue
            options = {"sample_by": "document"} if builder == "text" else {}
            dataset = load_dataset(builder, data_files=group, split="train", cache_dir=cache, **options)
            field = "text" if builder == "text" else text_field
            texts += [t for t in dataset[field] if t]
    return texts
