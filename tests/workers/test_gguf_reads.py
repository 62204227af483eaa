"""gguf_read_once: a GGUF parsed once however often transformers reads it, gguf's own names back afterwards."""
import threading

import gguf
import numpy as np
import pytest

from kvtc.workers.gguf_reads import gguf_read_once
from kvtc.workers.models import gguf_fields


def _write(path, name="tiny"):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(256)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_parse_per_file_inside_and_gguf_untouched_outside(tmp_path, monkeypatch):
    parses = []
    original = gguf.GGUFReader

    class Counting(original):
        def __init__(self, path, mode="r"):
            parses.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    a, b = _write(tmp_path / "a.gguf"), _write(tmp_path / "b.gguf", "other")
    names = gguf.get_tensor_name_map
    with gguf_read_once():
        first = gguf.GGUFReader(a)
        with gguf_read_once():  # re-entrant: the inner scope shares the outer one's reads
            assert gguf.GGUFReader(str(a)) is first
        assert gguf.GGUFReader(b) is not first
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert bytes(first.fields["general.name"].parts[-1]).decode() == "tiny"
    assert parses == [str(a), str(b)]
    assert gguf.GGUFReader is Counting and gguf.get_tensor_name_map is names
    gguf.GGUFReader(a)  # outside: parsed again, as gguf does
    assert len(parses) == 3


def test_a_file_replaced_inside_the_scope_is_parsed_again(tmp_path):
    path = _write(tmp_path / "m.gguf")
    with gguf_read_once():
        before = gguf.GGUFReader(path)
        _write(tmp_path / "n.gguf", "changed").replace(path)
        after = gguf.GGUFReader(path)
        assert after is not before and bytes(after.fields["general.name"].parts[-1]).decode() == "changed"


def test_names_are_restored_when_the_scope_raises_and_scopes_on_threads_share_one_patch(tmp_path):
    reader = gguf.GGUFReader
    with pytest.raises(RuntimeError), gguf_read_once():
        raise RuntimeError("boom")
    assert gguf.GGUFReader is reader
    path, seen, go = _write(tmp_path / "t.gguf"), [], threading.Barrier(2)

    def use():
        with gguf_read_once():
            go.wait()
            seen.append(gguf.GGUFReader(path))
            go.wait()

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[0] is seen[1] and gguf.GGUFReader is reader


def test_gguf_fields_reads_the_header_scalars_without_gguf_reader(tmp_path, monkeypatch):
    path = _write(tmp_path / "f.gguf")
    monkeypatch.setattr(gguf, "GGUFReader", None)  # not used: the checked header is read instead
    fields = gguf_fields(path)
    assert fields["general.architecture"] == "llama" and fields["general.name"] == "tiny"
    assert fields["llama.context_length"] == 256 and "tokenizer.ggml.tokens" not in fields
