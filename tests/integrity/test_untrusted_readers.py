"""Every file a user or a peer can plant is opened one way: `kvtc.artifacts.safe_io.open_regular` (non-blocking, a
regular file required, links refused or followed only as asked) or a reader built on it (`read_limited`,
`open_untrusted`, `copy_limited`). The package's source is scanned for every other read: each must be listed below
with why it is not an untrusted file, so a new reader that bypasses the helper fails here."""
from __future__ import annotations

import ast
import os
import re
import stat
import threading
from pathlib import Path

import pytest

from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.safe_io import open_regular, read_limited

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("artifacts", "kernels", "pipeline", "workers")
HELPER = "artifacts/safe_io.py"

# (file, function) -> why the read there is not of a file someone else could plant
NOT_UNTRUSTED = {
    ("artifacts/bundle.py", "kernel_sources"): "the installed package's own codec sources",
    ("artifacts/local_files.py", "process_umask"): "/proc/self/status",
    ("pipeline/commands/__init__.py", "module_doc"): "a kvtc module's own source, for --help",
    ("pipeline/commands/export.py", "cmd_export"): "the export file this command has just written",
}
READ_ATTRS = ("read_text", "read_bytes")


MODE = re.compile(r"[rwxabt+]{1,4}")


def _mode(call: ast.Call) -> str:
    """The mode of an open() call: its literal argument that reads as a mode ("r" when none does)."""
    for node in list(call.args[:2]) + [k.value for k in call.keywords if k.arg == "mode"]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODE.fullmatch(node.value):
            return node.value
    return "r"


def _reads(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every read of a file by path in a module."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                f = child.func
                if isinstance(f, ast.Name) and f.id == "open":
                    if not any(c in _mode(child) for c in "wax"):
                        found.append((where, child.lineno))
                elif isinstance(f, ast.Attribute) and f.attr in READ_ATTRS:
                    found.append((where, child.lineno))
                elif isinstance(f, ast.Attribute) and f.attr == "open":
                    owner = f.value.id if isinstance(f.value, ast.Name) else ""
                    if owner == "os":  # os.open(path, flags): a write only with O_WRONLY / O_CREAT
                        flags = ast.unparse(child.args[1]) if len(child.args) > 1 else ""
                        if "O_WRONLY" not in flags and "O_CREAT" not in flags:
                            found.append((where, child.lineno))
                    elif not any(c in _mode(child) for c in "wax"):  # Path.open, fs.open, fsspec.open, tokenize.open
                        found.append((where, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_every_reader_of_a_plantable_file_goes_through_the_helper():
    bypass, stale = [], set(NOT_UNTRUSTED)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == HELPER:
                continue
            for where, line in _reads(ast.parse(path.read_text(), rel)):
                stale.discard((rel, where))
                if (rel, where) not in NOT_UNTRUSTED:
                    bypass.append(f"{rel}:{line} in {where}()")
    assert not bypass, ("files read without kvtc.artifacts.safe_io.open_regular (use it, or list the reader in "
                        "NOT_UNTRUSTED with why no one can plant that file):\n" + "\n".join(bypass))
    assert not stale, f"NOT_UNTRUSTED lists readers that are gone: {sorted(stale)}"


def _within(seconds: float, fn):
    """fn() run in a thread; its result or exception, or a failure when it has not returned in `seconds`."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "FIFO"), ("/dev/zero", "character device"), (tmp_path, "directory")):
        with pytest.raises(IntegrityError, match=kind):
            _within(5, lambda p=path: open_regular(str(p), "test file"))
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100)
    with pytest.raises(IntegrityError, match="more than the 10 bytes"):
        read_limited(None, True, str(big), 10, "test file")


def test_links_are_refused_followed_in_their_folder_or_followed_as_asked(tmp_path):
    """A Kubernetes Secret volume mounts `key -> ..data/key` and `..data -> ..2026_x`: followed with
    links="in_folder"; a link out of its folder is refused naming the target to give instead."""
    mount = tmp_path / "secret"
    (mount / "..2026_x").mkdir(parents=True)
    (mount / "..2026_x" / "key").write_bytes(b"k" * 32)
    (mount / "..data").symlink_to("..2026_x")
    (mount / "key").symlink_to("..data/key")
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"o")
    (mount / "out").symlink_to(outside)
    with pytest.raises(IntegrityError, match="symlink"):
        open_regular(str(mount / "key"), "test key")
    assert read_limited(None, True, str(mount / "key"), 64, "test key", links="in_folder") == b"k" * 32
    with pytest.raises(IntegrityError, match=f"give {outside}"):
        read_limited(None, True, str(mount / "out"), 64, "test key", links="in_folder")
    assert read_limited(None, True, str(mount / "out"), 64, "test key", links="follow") == b"o"
    (mount / "zero").symlink_to("/dev/zero")
    with pytest.raises(IntegrityError, match="character device"):
        read_limited(None, True, str(mount / "zero"), 64, "test key", links="follow")


def test_a_special_or_oversized_conversion_record_means_convert_again(tmp_path):
    """The converted model's record as a FIFO hung, as a link to /dev/zero exhausted memory: now each is named
    once as the folder's problem (the caller converts again), at once."""
    from kvtc.workers.models import CONVERSION_RECORD, RECORD_LIMIT, conversion_problem

    record = tmp_path / CONVERSION_RECORD
    os.mkfifo(record)
    assert "FIFO" in _within(5, lambda: conversion_problem(tmp_path, "0" * 64))
    record.unlink()
    record.symlink_to("/dev/zero")
    assert "symlink" in _within(5, lambda: conversion_problem(tmp_path, "0" * 64))
    record.unlink()
    record.write_bytes(b" " * (RECORD_LIMIT + 1))
    assert "more than" in conversion_problem(tmp_path, "0" * 64)
    assert stat.S_ISREG(record.stat().st_mode)
