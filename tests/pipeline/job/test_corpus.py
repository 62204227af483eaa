"""Corpus specs -> documents: every spec form, deterministic order, bad input skipped or refused clearly."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtc.pipeline.job.corpus import (PKGDOCS_MIN_CHARS, ReadCounts, CorpusWarning, HFSpec, describe, iter_documents,
                                      parse_hf_spec)


def docs(spec: str, **kwargs) -> list:
    return list(iter_documents(spec, **kwargs))


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    (tmp_path / "b.txt").write_text("second file\nwith two lines\n")
    (tmp_path / "a.txt").write_text("first file")
    rows = [{"text": "row zero"}, {"body": "no text key"}, {"text": ""}, {"text": "row three"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n\n")
    pq.write_table(pa.table({"text": ["p0", None, "p2"], "body": ["b0", "b1", "b2"]}), tmp_path / "d.parquet")
    (tmp_path / "notes.md").write_text("ignored: not a corpus suffix")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("ignored: hidden")
    return tmp_path


def test_pydoc_is_one_document_per_topic_in_key_order() -> None:
    from pydoc_data.topics import topics

    got = docs("pydoc")
    keys = [d.id.removeprefix("pydoc:") for d in got]
    assert keys == sorted(k for k in topics if topics[k].strip())
    assert got[0].text == topics[keys[0]]


def test_stdlib_reads_sources_sorted_without_tests_or_site_packages() -> None:
    counts = ReadCounts()
    got = docs("stdlib", counts=counts)
    ids = [d.id for d in got]
    assert ids == sorted(ids) and len(ids) > 200
    assert "stdlib:json/decoder.py" in ids
    assert all(d.endswith(".py") for d in ids)
    for excluded in ("site-packages/", "test/", "idlelib/", "tkinter/", "pydoc_data/"):
        assert not any(f"stdlib:{excluded}" in i or f"/{excluded}" in i for i in ids), excluded
    assert "def JSONArray" in next(d.text for d in got if d.id == "stdlib:json/decoder.py")
    assert counts.documents == len(got) and counts.files_read == len(got)


def test_txt_file_is_one_document(files: Path) -> None:
    (doc,) = docs(str(files / "b.txt"))
    assert doc.text == "second file\nwith two lines\n" and doc.id == str(files / "b.txt")


def test_jsonl_yields_text_column_and_counts_bad_records(files: Path) -> None:
    counts = ReadCounts()
    assert [d.text for d in docs(str(files / "c.jsonl"), counts=counts)] == ["row zero", "row three"]
    assert counts.records_skipped == 3 and counts.files_skipped == 0
    assert [d.text for d in docs(str(files / "c.jsonl"), text_column="body")] == ["no text key"]


def test_parquet_text_column_and_override(files: Path) -> None:
    assert [d.text for d in docs(str(files / "d.parquet"))] == ["p0", "p2"]
    assert [d.text for d in docs(str(files / "d.parquet"), text_column="body")] == ["b0", "b1", "b2"]
    assert [d.text for d in docs(f"{files / 'd.parquet'}#body")] == ["b0", "b1", "b2"]
    with pytest.raises(ValueError, match="names column 'body' but text_column='text'"):
        docs(f"{files / 'd.parquet'}#body", text_column="text")


def test_directory_reads_corpus_files_sorted(files: Path) -> None:
    got = [d.text for d in docs(str(files) + "/")]
    assert got == ["first file", "second file\nwith two lines\n", "row zero", "row three", "p0", "p2"]
    assert [d.text for d in docs(str(files))] == got


def test_glob_and_joined_specs(files: Path) -> None:
    assert [d.text for d in docs(str(files / "*.txt"))] == ["first file", "second file\nwith two lines\n"]
    assert [d.id for d in docs(str(files / "*"))] == [d.id for d in docs(str(files))], "non-corpus suffixes ignored"
    joined = docs(f"{files / 'a.txt'},pydoc")
    assert joined[0].text == "first file" and joined[1].id.startswith("pydoc:")


def test_hf_spec_grammar() -> None:
    assert parse_hf_spec("hf:HuggingFaceFW/fineweb") == HFSpec("HuggingFaceFW/fineweb")
    assert parse_hf_spec("hf:org/name:sample-10BT@validation#content") == HFSpec(
        "org/name", "sample-10BT", "validation", "content")
    assert parse_hf_spec("hf:org/name#body") == HFSpec("org/name", column="body")
    for bad in ("hf:", "hf:org/name@", "hf:org/name#", "hf:a:b:c"):
        with pytest.raises(ValueError, match=r"hf:ORG/NAME\[:CONFIG\]\[@SPLIT\]\[#COLUMN\]"):
            parse_hf_spec(bad)


def test_hf_local_dataset_directory_streams_offline(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["hello there", "", "second doc"]}), tmp_path / "train.parquet")
    counts = ReadCounts()
    got = docs(f"hf:{tmp_path}@train#body", counts=counts)
    assert [d.text for d in got] == ["hello there", "second doc"] and counts.records_skipped == 1
    with pytest.raises(ValueError, match="no column 'text'"):
        docs(f"hf:{tmp_path}")
    with pytest.raises(ValueError, match=r"cannot open hf:.*missing@train"):
        docs(f"hf:{tmp_path / 'missing'}")


def test_unknown_spec_lists_accepted_forms() -> None:
    for bad in ("wikipedia", "corpus.csv", "", "pydoc,,stdlib"):
        with pytest.raises(ValueError, match=r"accepted forms: pydoc \| pkgdocs \| stdlib \| hf:ORG/NAME"):
            iter_documents(bad)


def test_bad_files_are_skipped_with_a_count(files: Path) -> None:
    (files / "empty.txt").write_text("  \n")
    (files / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    counts = ReadCounts()
    with pytest.warns(CorpusWarning) as caught:
        got = docs(f"{files / '*.txt'},{files / 'missing.txt'}", counts=counts)
    assert [d.text for d in got] == ["first file", "second file\nwith two lines\n"]
    assert counts.files_skipped == 3 and counts.files_read == 2
    reasons = dict(counts.skipped)
    assert reasons[str(files / "empty.txt")] == "empty"
    assert reasons[str(files / "latin1.txt")].startswith("not UTF-8")
    assert reasons[str(files / "missing.txt")] == "file not found"
    assert len(caught) == 3


def test_nothing_usable_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CorpusWarning)
        no_file = r"no usable document \(1 file\(s\) skipped: .*missing\.txt: file not found"
        with pytest.raises(ValueError, match=no_file):
            docs(str(tmp_path / "missing.txt"))
        with pytest.raises(ValueError, match=r"2 file\(s\) skipped: .*not UTF-8.*unreadable"):
            docs(str(tmp_path))
        with pytest.raises(ValueError, match="no .txt/.jsonl/.parquet file matched"):
            docs(str(tmp_path / "nothing*.jsonl"))


def test_mixture_interleaves_pydoc_and_installed_package_descriptions(files: Path) -> None:
    docs = list(iter_documents("pydoc+pkgdocs"))
    kinds = [d.id.split(":")[0] for d in docs]
    assert kinds[:6] == ["pydoc", "pkgdocs"] * 3  # any prefix is a mixture
    pkg = [d for d in docs if d.id.startswith("pkgdocs:")]
    assert len(pkg) >= 5 and all(len(d.text) >= PKGDOCS_MIN_CHARS and "==" in d.id for d in pkg)
    assert [d.id for d in pkg] == sorted((d.id for d in pkg), key=lambda i: i.split(":")[1].split("==")[0].lower().replace("_", "-"))
    assert not any(d.id.startswith("pkgdocs:kvtc-calibration") for d in pkg)
    described = describe("pydoc+pkgdocs,stdlib")
    assert described["parts"] == [["pydoc", "pkgdocs"], ["stdlib"]]
    assert described["pkgdocs"] == [d.id.split(":", 1)[1] for d in pkg]
    plus = files / "a+b.txt"
    plus.write_text("a file whose name holds a plus")
    assert [d.text for d in iter_documents(str(plus))] == ["a file whose name holds a plus"]
    with pytest.raises(ValueError, match="empty part"):
        iter_documents("pydoc+")


def test_a_recorded_pkgdocs_corpus_reads_exactly_its_distributions_whatever_was_installed_since():
    """The held-out text of a published artifact is rebuilt from the distributions its manifest recorded
    (`mixture.pkgdocs`): a package installed since (one more document in the interleave) must not move it."""
    from kvtc.pipeline.job.corpus import describe, iter_documents

    recorded = describe("pkgdocs")["pkgdocs"]
    assert len(recorded) >= 3
    pinned = recorded[1:]  # as if the first had been installed after the calibration
    got = [d.id.split(":", 1)[1] for d in iter_documents("pkgdocs", pkgdocs=pinned)]
    assert got == pinned
    with pytest.raises(ValueError, match="no longer installed"):
        list(iter_documents("pkgdocs", pkgdocs=pinned + ["no-such-package==0.0"]))
