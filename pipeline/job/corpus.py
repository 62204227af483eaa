"""Calibration corpora: turn a corpus spec into a stream of text documents.

Spec grammar (several specs may be joined with ',' and are read in that order, or with '+' and
interleaved document by document, round robin, so any prefix of the stream is a mixture):

    pydoc+pkgdocs                       the default calibration corpus: a mixture of the two below
    pydoc                               Python's documentation prose (pydoc_data.topics), one document per topic, by key
    pkgdocs                             the long descriptions (README prose and markdown on every topic) that the
                                        Python distributions installed in the environment's site-packages carry in
                                        their metadata, one per distribution, by name; descriptions under
                                        PKGDOCS_MIN_CHARS are skipped
    stdlib                              the standard library's .py sources, one document per file, by path
                                        (no site-packages, test suites, GUI packages, codec tables, pydoc_data)
    hf:NAME[:CONFIG][@SPLIT][#COLUMN]   a `datasets` dataset, streamed; NAME is a hub id ORG/NAME or a local
                                        dataset directory; SPLIT defaults to "train"
    FILE.txt                            the whole file is one document
    FILE.jsonl                          one document per line: the text column of each JSON object
    FILE.parquet                        one document per row: the text column
    DIR or DIR/                         every .txt/.jsonl/.parquet file below DIR, sorted by path
    GLOB                                matching files (*, ?, [...]; ** recurses), sorted by path
    any of the above + '#COLUMN'        the text column for .jsonl/.parquet/hf sources (default: text_column or "text")

Files that are missing, empty, unreadable or not UTF-8, and records without a usable text, are
skipped: each skipped file raises a `CorpusWarning` and is counted in `ReadCounts`. When nothing
usable remains, a ValueError names the reasons.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from pydoc_data.topics import topics

from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.safe_io import open_regular, read_limited

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
DEFAULT_TEXT_COLUMN = "text"
TEXT_FILE_LIMIT = 1 << 30  # one .txt document; larger text belongs in a .jsonl or .parquet of records
STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo",
    "lib2to3", "ensurepip", "encodings", "pydoc_data", "lib-dynload", "__pycache__",
})
PKGDOCS_MIN_CHARS = 500
ACCEPTED_FORMS = ("pydoc | pkgdocs | stdlib | hf:ORG/NAME[:CONFIG][@SPLIT][#COLUMN] | FILE.txt | FILE.jsonl[#COLUMN] | "
                  "FILE.parquet[#COLUMN] | DIR/ | GLOB (e.g. data/*.jsonl); join several with ',' (in order) "
                  "or '+' (interleaved), e.g. pydoc+pkgdocs")
Source = Callable[["ReadCounts"], Iterator["Document"]]


class CorpusWarning(UserWarning):
    """A corpus file was skipped."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str


@dataclass
class ReadCounts:
    """What reading the corpus did; filled in as the stream is consumed."""

    documents: int = 0
    files_read: int = 0
    files_skipped: int = 0
    records_skipped: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip_file(self, source: str, reason: str) -> None:
        self.files_skipped += 1
        self.skipped.append((source, reason))
        warnings.warn(f"corpus: skipping {source}: {reason}", CorpusWarning, stacklevel=3)


@dataclass(frozen=True)
class HFSpec:
    name: str
    config: str | None = None
    split: str = "train"
    column: str | None = None


def parse_hf_spec(spec: str) -> HFSpec:
    """Parse 'hf:NAME[:CONFIG][@SPLIT][#COLUMN]'."""
    if not spec.startswith("hf:"):
        raise ValueError(f"not an hf spec: {spec!r}; expected hf:ORG/NAME[:CONFIG][@SPLIT][#COLUMN]")
    rest, column = _split_last(spec[3:], "#")
    rest, split = _split_last(rest, "@")
    name, _, config = rest.partition(":")
    if not name or (column is not None and not column) or (split is not None and not split) or ":" in config:
        raise ValueError(f"malformed hf spec {spec!r}; expected hf:ORG/NAME[:CONFIG][@SPLIT][#COLUMN]")
    return HFSpec(name=name, config=config or None, split=split or "train", column=column)


def _split_last(text: str, sep: str) -> tuple[str, str | None]:
    head, found, tail = text.rpartition(sep)
    return (head, tail) if found else (text, None)


def iter_documents(spec: str, text_column: str | None = None, counts: ReadCounts | None = None,
                   pkgdocs: Sequence[str] | None = None) -> Iterator[Document]:
    """The documents of `spec` in a deterministic order (grammar: module docstring). Bad specs fail here, eagerly.
    pkgdocs: the "name==version" distributions a recorded corpus read (its manifest's `mixture.pkgdocs`): exactly
    those are read again, whatever was installed since (ValueError naming any no longer installed)."""
    counts = counts if counts is not None else ReadCounts()
    parts = [part.strip() for part in spec.split(",")]
    if not spec.strip() or not all(parts):
        raise ValueError(f"empty corpus spec {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    mixed = [_mixed_parts(part) for part in parts]
    if any(not p for m in mixed for p in m):
        raise ValueError(f"empty part in corpus spec {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    sources = [_mixture([_resolve(p, text_column, pkgdocs) for p in m]) for m in mixed]
    return _stream(spec, sources, counts)


def _mixed_parts(part: str) -> list[str]:
    """'A+B' -> [A, B]; a path that exists (its name may hold '+') stays whole."""
    if "+" not in part or Path(part).exists() or glob.has_magic(part):
        return [part]
    return [p.strip() for p in part.split("+")]


def _mixture(sources: list[Source]) -> Source:
    """One source, or several interleaved document by document (round robin until all run out)."""
    if len(sources) == 1:
        return sources[0]

    def interleave(counts: ReadCounts) -> Iterator[Document]:
        live = [source(counts) for source in sources]
        while live:
            for it in list(live):
                doc = next(it, None)
                if doc is None:
                    live.remove(it)
                else:
                    yield doc

    return interleave


def describe(spec: str) -> dict:
    """What the manifest records about a corpus spec: its parts, and for pkgdocs the distributions read."""
    parts = [_mixed_parts(part.strip()) for part in spec.split(",")]
    out: dict = {"spec": spec, "parts": parts}
    if any(p == "pkgdocs" for m in parts for p in m):
        out["pkgdocs"] = [doc.id.split(":", 1)[1] for doc in _pkgdocs_documents()]
    return out


def _stream(spec: str, sources: list[Source], counts: ReadCounts) -> Iterator[Document]:
    before = counts.documents
    for source in sources:
        for doc in source(counts):
            counts.documents += 1
            yield doc
    if counts.documents == before:
        reasons = "; ".join(f"{src}: {why}" for src, why in counts.skipped[:5]) or "no documents"
        raise ValueError(f"corpus {spec!r} has no usable document ({counts.files_skipped} file(s) skipped: {reasons})")


def _resolve(part: str, text_column: str | None, pkgdocs: Sequence[str] | None = None) -> Source:
    if part == "pydoc":
        return lambda counts: _pydoc_documents()
    if part == "stdlib":
        return _stdlib_documents
    if part == "pkgdocs":
        return lambda counts: _pkgdocs_documents(pkgdocs)
    if part.startswith("hf:"):
        hf = parse_hf_spec(part)
        column = _pick_column(part, hf.column, text_column)
        return lambda counts: _hf_documents(hf, column, counts)
    path, column = part, None
    if not glob.has_magic(part) and not Path(part).exists() and "#" in part:
        path, column = _split_last(part, "#")
    column = _pick_column(part, column, text_column)
    if glob.has_magic(path):
        matches = [p for p in glob.glob(path, recursive=True) if Path(p).suffix in FILE_SUFFIXES]
        return lambda counts: _files_documents(sorted(matches), column, counts, path)
    if Path(path).is_dir():
        return lambda counts: _files_documents(_walk(Path(path)), column, counts, path)
    if Path(path).suffix in FILE_SUFFIXES:
        return lambda counts: _files_documents([path], column, counts, path)
    raise ValueError(f"unknown corpus spec {part!r} (not a known name, directory, glob or "
                     f"{'/'.join(FILE_SUFFIXES)} file); accepted forms: {ACCEPTED_FORMS}")


def _pick_column(part: str, in_spec: str | None, argument: str | None) -> str:
    if in_spec is not None and argument is not None and in_spec != argument:
        raise ValueError(f"corpus spec {part!r} names column {in_spec!r} but text_column={argument!r}; give one")
    return in_spec or argument or DEFAULT_TEXT_COLUMN


def _walk(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*")
                  if p.suffix in FILE_SUFFIXES and not any(s.startswith(".") for s in p.relative_to(root).parts))


def _pydoc_documents() -> Iterator[Document]:
    for key in sorted(topics):
        if topics[key].strip():
            yield Document(id=f"pydoc:{key}", text=topics[key])


def _pkgdocs_documents(pinned: Sequence[str] | None = None) -> Iterator[Document]:
    """The installed distributions' long descriptions, or exactly the `pinned` "name==version" ones."""
    docs = _pkgdocs_snapshot()
    if pinned is None:
        yield from docs
        return
    wanted = set(pinned)
    found = [d for d in docs if d.id.split(":", 1)[1] in wanted]
    missing = sorted(wanted - {d.id.split(":", 1)[1] for d in found})
    if missing:
        raise ValueError(f"the corpus read the documentation of {len(wanted)} installed packages, and "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} are no longer installed at "
                         "those versions: its held-out text cannot be rebuilt here; pass --corpus")
    yield from found


@functools.lru_cache(maxsize=1)
def _pkgdocs_snapshot() -> tuple[Document, ...]:
    """The installed distributions' documents, read once per process: a package installed while a job runs (between
    its fold and its served check's rebuild of the held-out shards) must not change the job's corpus."""
    # the environment's site-packages only: sys.path additions (Ray's vendored packages) must not change the corpus
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    seen: dict[str, Document] = {}
    for dist in metadata.distributions(path=paths):
        name = (dist.metadata.get("Name") or "").strip()
        key = name.lower().replace("_", "-")
        if not key or key in seen or key == "kvtc-calibration":
            continue
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if isinstance(text, str) and len(text.strip()) >= PKGDOCS_MIN_CHARS:
            seen[key] = Document(id=f"pkgdocs:{name}=={dist.version}", text=text)
    return tuple(seen[key] for key in sorted(seen))


def _stdlib_documents(counts: ReadCounts) -> Iterator[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for rel in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")):
        parts = rel.split("/")
        excluded = any(d in STDLIB_EXCLUDED_DIRS or d.startswith("config-") for d in parts[:-1])
        if excluded or parts[-1].startswith("_sysconfigdata") or (root / rel).stat().st_size == 0:
            continue
        text = _read_text(root / rel, f"stdlib:{rel}", counts)
        if text is not None:
            yield Document(id=f"stdlib:{rel}", text=text)


def _read_text(path: Path, source: str, counts: ReadCounts) -> str | None:
    try:
        text = read_limited(None, True, str(path), TEXT_FILE_LIMIT, "corpus file", links="follow").decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 ({exc.reason} at byte {exc.start})"
    except OSError as exc:
        reason = f"unreadable ({exc.strerror or exc})"
    except IntegrityError as exc:  # a FIFO, a device, a file beyond TEXT_FILE_LIMIT
        reason = f"unusable ({exc})"
    else:
        if text.strip():
            counts.files_read += 1
            return text
        reason = "empty"
    counts.skip_file(source, reason)
    return None


def _files_documents(paths: list[str], column: str, counts: ReadCounts, spec: str) -> Iterator[Document]:
    if not paths:
        counts.skip_file(spec, "no .txt/.jsonl/.parquet file matched")
    for name in paths:
        path = Path(name)
        if not path.exists():
            counts.skip_file(name, "file not found")
        elif path.suffix == ".txt":
            text = _read_text(path, name, counts)
            if text is not None:
                yield Document(id=name, text=text)
        elif path.suffix in (".jsonl", ".parquet"):
            read = _jsonl_records if path.suffix == ".jsonl" else _parquet_records
            count = 0
            try:
                for i, text in enumerate(read(path, column, counts)):
                    if isinstance(text, str) and text.strip():
                        count += 1
                        yield Document(id=f"{name}:{i}", text=text)
                    else:
                        counts.records_skipped += 1
            except (OSError, ValueError, IntegrityError) as exc:
                counts.skip_file(name, f"unreadable ({exc})")
            else:
                counts.files_read += count > 0
                if not count:
                    counts.skip_file(name, f"no record with a non-empty {column!r} text")


def _jsonl_records(path: Path, column: str, counts: ReadCounts) -> Iterator[object]:
    with os.fdopen(open_regular(str(path), "corpus file", links="follow"), "rb") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                counts.records_skipped += 1
                continue
            yield record.get(column) if isinstance(record, dict) else None


def _parquet_records(path: Path, column: str, counts: ReadCounts) -> Iterator[object]:
    import pyarrow.parquet as pq  # noqa: PLC0415 - only for a Parquet corpus: the corpus reader stays light

    parquet = pq.ParquetFile(os.fdopen(open_regular(str(path), "corpus file", links="follow"), "rb"))
    if column not in parquet.schema_arrow.names:
        raise ValueError(f"no column {column!r} (columns: {', '.join(parquet.schema_arrow.names)}); set text_column")
    for batch in parquet.iter_batches(columns=[column], batch_size=256):
        yield from batch.column(0).to_pylist()


def _hf_documents(hf: HFSpec, column: str, counts: ReadCounts) -> Iterator[Document]:
    import datasets  # noqa: PLC0415 - heavy: only for an hf: corpus

    source = f"hf:{hf.name}" + (f":{hf.config}" if hf.config else "") + f"@{hf.split}"
    try:
        dataset = datasets.load_dataset(hf.name, hf.config, split=hf.split, streaming=True)
    except Exception as exc:  # datasets raises many unrelated types; name the source and the likely causes
        raise ValueError(f"cannot open {source} ({type(exc).__name__}: {exc}); check the name, config and split, "
                         "and hub access (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)") from exc
    for i, record in enumerate(dataset):
        if column not in record:
            raise ValueError(f"{source} has no column {column!r} (columns: {', '.join(record)}); "
                             f"use {source}#COLUMN or text_column=")
        text = record[column]
        if isinstance(text, str) and text.strip():
            yield Document(id=f"{source}:{i}", text=text)
        else:
            counts.records_skipped += 1
