"""WMT newstest ``.sgm`` files -> tab-separated sentence pairs, like the MindSpore tutorial's ``wmt14.fr_en.txt``.

A newstest file is "fake SGML" (``<doc docid=..>`` blocks of ``<seg id=..>text</seg>`` lines, HTML
entities), not well-formed XML, so it is read with a few regular expressions and ``html.unescape``.
Source and reference are paired by (document id, segment id); a mismatch, or text outside a
``<seg>``, is an error naming the document and segment, so nothing is dropped.
"""
from __future__ import annotations

import html
import os
import re
import tarfile
from pathlib import Path

from paratrain.data import DataError, not_utf8
from paratrain.errors import UserError

_ATTR = re.compile(r"""(\w+)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))""")
_DOC = re.compile(r"<doc\b([^>]*)>(.*?)</doc\s*>", re.S | re.I)
_SEG = re.compile(r"<seg\b([^>]*)>(.*?)</seg\s*>", re.S | re.I)
_LAYOUT_TAG = re.compile(r"</?(?:p|hl)\b[^>]*>", re.I)
_SET_TAG = re.compile(r"</?(?:srcset|refset|tstset)\b[^>]*>", re.I)


class SgmError(UserError, ValueError):
    """A newstest file that cannot be read or paired; the message names the file, document and segment."""


def _attributes(text: str) -> dict[str, str]:
    return {m[1].lower(): next(v for v in m.groups()[1:] if v is not None) for m in _ATTR.finditer(text)}


def _context(text: str, start: int) -> str:
    return f"line {text.count(chr(10), 0, start) + 1}"


def parse_sgm(text: str, name: str = "<sgm>") -> dict[str, dict[str, str]]:
    """Documents of one newstest file: ``{docid: {seg id: text}}``, both in file order; SgmError for a
    malformed document or segment, or text outside a ``<seg>``."""
    docs: dict[str, dict[str, str]] = {}
    outside = _SET_TAG.sub("", _DOC.sub("", text))
    if "<seg" in outside.lower():
        raise SgmError(f"{name}: a <seg> lies outside any <doc> ({_context(text, text.lower().find('<seg'))})")
    if "<doc" in outside.lower():
        raise SgmError(f"{name}: a <doc> is not closed by </doc> ({_context(text, text.lower().rfind('<doc'))})")
    if outside.strip():
        raise SgmError(f"{name}: text outside any <doc>: {outside.strip()[:60]!r}")
    for doc in _DOC.finditer(text):
        docid = _attributes(doc[1]).get("docid")
        if docid is None:
            raise SgmError(f"{name}: <doc{doc[1]}> has no docid attribute ({_context(text, doc.start())})")
        if docid in docs:
            raise SgmError(f"{name}: document {docid!r} appears twice ({_context(text, doc.start())})")
        if "<doc" in doc[2].lower():
            raise SgmError(f"{name}: document {docid!r} is not closed by </doc> ({_context(text, doc.start())})")
        segs = docs[docid] = {}
        for seg in _SEG.finditer(doc[2]):
            seg_id = _attributes(seg[1]).get("id")
            if seg_id is None or seg_id in segs:
                problem = "a <seg> without an id" if seg_id is None else f"segment id {seg_id} twice"
                where = _context(text, doc.start(2) + seg.start())
                raise SgmError(f"{name}: document {docid!r} has {problem} ({where})")
            segs[seg_id] = " ".join(html.unescape(seg[2]).split())  # tabs and newlines too: one line per pair
        stray = _LAYOUT_TAG.sub("", _SEG.sub("", doc[2])).strip()
        if stray:
            raise SgmError(f"{name}: document {docid!r} has text outside <seg>: {stray[:60]!r}")
    return docs


def pair_documents(src: dict[str, dict[str, str]], ref: dict[str, dict[str, str]],
                   src_name: str = "source", ref_name: str = "reference") -> list[tuple[str, str]]:
    """(source, reference) sentence pairs in source order; SgmError listing every unmatched document/segment."""
    problems = [f"document {docid!r} is in {ref_name} but not in {src_name}" for docid in ref.keys() - src.keys()]
    pairs = []
    for docid, segs in src.items():
        if docid not in ref:
            problems.append(f"document {docid!r} is in {src_name} but not in {ref_name}")
            continue
        for seg_id in segs.keys() - ref[docid].keys():
            problems.append(f"document {docid!r}: segment {seg_id} is in {src_name} but not in {ref_name}")
        for seg_id in ref[docid].keys() - segs.keys():
            problems.append(f"document {docid!r}: segment {seg_id} is in {ref_name} but not in {src_name}")
        pairs += [(text, ref[docid][seg_id]) for seg_id, text in segs.items() if seg_id in ref[docid]]
    if problems:
        shown = sorted(problems)[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise SgmError("source and reference do not match:\n" + "\n".join(f"  - {p}" for p in shown))
    return pairs


def language_of(name: str) -> str:
    """The language code in a newstest file name: ``newstest2014-fren-src.en.sgm`` -> ``en``."""
    parts = Path(name).name.split(".")
    if len(parts) < 3 or parts[-1].lower() != "sgm":
        raise SgmError(f"cannot tell the language of {name}: expected a name like newstest2014-fren-src.en.sgm "
                       f"(or pass the language explicitly)")
    return parts[-2]


def write_pairs(pairs: list[tuple[str, str]], path: str | Path) -> Path:
    """One ``left<TAB>right`` line per pair, UTF-8, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{a}\t{b}\n" for a, b in pairs), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """The pairs of a file written by ``write_pairs``; a line without exactly one tab is an error."""
    pairs = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                fields = line.rstrip("\n").split("\t")
                if len(fields) != 2:
                    raise DataError(f"{path}:{number}: expected 'source<TAB>target', found {len(fields) - 1} tabs")
                pairs.append((fields[0], fields[1]))
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None
    return pairs


def preprocess(src_text: str, ref_text: str, src_lang: str, tgt_lang: str, out_dir: str | Path,
               src_name: str = "source", ref_name: str = "reference", prefix: str = "wmt14") -> dict[str, Path]:
    """Pair two newstest files and write ``{prefix}.{src}_{tgt}.txt`` and the reverse ``{prefix}.{tgt}_{src}.txt``."""
    pairs = pair_documents(parse_sgm(src_text, src_name), parse_sgm(ref_text, ref_name), src_name, ref_name)
    out_dir = Path(out_dir)
    return {f"{src_lang}_{tgt_lang}": write_pairs(pairs, out_dir / f"{prefix}.{src_lang}_{tgt_lang}.txt"),
            f"{tgt_lang}_{src_lang}": write_pairs([(b, a) for a, b in pairs],
                                                  out_dir / f"{prefix}.{tgt_lang}_{src_lang}.txt")}


def preprocess_files(src: str | Path, ref: str | Path, out_dir: str | Path, src_lang: str | None = None,
                     tgt_lang: str | None = None, prefix: str = "wmt14") -> dict[str, Path]:
    """``preprocess`` on two ``.sgm`` files; languages default to the ones in the file names."""
    return preprocess(_read_sgm(src), _read_sgm(ref), src_lang or language_of(src), tgt_lang or language_of(ref),
                      out_dir, str(src), str(ref), prefix)


def _read_sgm(path: str | Path) -> str:
    """The text of a ``.sgm`` file; SgmError naming it when it is missing, unreadable or not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise SgmError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise SgmError(f"{path} is a directory: give the .sgm file in it") from None
    except OSError as exc:
        raise SgmError(f"{path} cannot be read ({exc.strerror})") from None
    return _decode(data, path)


def _decode(data: bytes, name) -> str:
    if b"\0" in data:
        raise SgmError(f"{name} is binary (it holds NUL bytes), not a newstest .sgm file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SgmError(f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start}): convert it to UTF-8") from None


def preprocess_archive(archive: str | Path, out_dir: str | Path, src_lang: str = "en", tgt_lang: str = "fr",
                       test_set: str = "newstest2014", prefix: str = "wmt14") -> dict[str, Path]:
    """Read ``{test_set}-{pair}-src.{src_lang}.sgm`` and ``-ref.{tgt_lang}.sgm`` straight from ``test-full.tgz``
    (``pair``: the two language codes in either order)."""
    try:
        tar = tarfile.open(archive)
    except FileNotFoundError:
        raise SgmError(f"{archive} does not exist") from None
    except OSError as exc:
        raise SgmError(f"{archive} cannot be read ({exc.strerror})") from None
    except tarfile.TarError:
        raise SgmError(f"{archive} is not a readable tar archive (such as WMT's test-full.tgz)") from None
    with tar:
        names = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

        def member(kind: str, lang: str) -> tarfile.TarInfo:
            for pair in (src_lang + tgt_lang, tgt_lang + src_lang):
                name = f"{test_set}-{pair}-{kind}.{lang}.sgm"
                if name in names:
                    return names[name]
            close = sorted(n for n in names if n.startswith(test_set))
            raise SgmError(f"{archive} has no {test_set}-{tgt_lang}{src_lang}-{kind}.{lang}.sgm; "
                           f"{test_set} files in it: {', '.join(close) or 'none'}")

        src, ref = member("src", src_lang), member("ref", tgt_lang)
        return preprocess(_decode(tar.extractfile(src).read(), f"{archive}:{src.name}"),
                          _decode(tar.extractfile(ref).read(), f"{archive}:{ref.name}"),
                          src_lang, tgt_lang, out_dir, f"{archive}:{src.name}", f"{archive}:{ref.name}", prefix)
