"""``io.files.write_whole``: a file appears under its name only once complete."""

import os

import pytest

from icqs_fast.io.files import write_whole


def test_write_whole_writes_text_and_bytes_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "a.json"
    write_whole(p, "héllo\n")
    assert p.read_bytes() == "héllo\n".encode()
    write_whole(p, b"\x00\x01", fsync=True)  # replaces the old content
    assert p.read_bytes() == b"\x00\x01"
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    p = tmp_path / "a.json"
    p.write_text("old")

    def boom(*_a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_whole(p, "new")
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_named_temporary_is_used_and_renamed(tmp_path):
    p, t = tmp_path / "block.parquet", tmp_path / "block.parquet.tmp.7"
    write_whole(p, b"x", tmp=t)
    assert p.read_bytes() == b"x" and not t.exists()
