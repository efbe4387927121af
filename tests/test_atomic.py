"""accord.atomic: a file or folder written through it is the old one or the whole new one."""

import os

import pytest

from accord.atomic import replacing, replacing_folder, write_atomic


def test_write_atomic_replaces_text_and_bytes_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "latest"
    write_atomic(path, "step-000010\n")
    write_atomic(path, "step-000020\n", durable=True)
    assert path.read_text() == "step-000020\n"
    write_atomic(path, b"\x00\xff")
    assert path.read_bytes() == b"\x00\xff"
    assert os.listdir(tmp_path) == ["latest"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "chunk.npz"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), replacing(path) as f:
        f.write(b"half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["chunk.npz"]


def test_the_new_file_has_the_permissions_a_plain_write_gives(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    write_atomic(tmp_path / "atomic", "x")
    assert (tmp_path / "atomic").stat().st_mode == plain.stat().st_mode


def test_replacing_folder_swaps_the_whole_folder_or_nothing(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "old.json").write_text("{}")
    with pytest.raises(RuntimeError), replacing_folder(final) as tmp:
        (tmp / "new.json").write_text("{}")
        raise RuntimeError("export failed")
    assert os.listdir(final) == ["old.json"] and os.listdir(tmp_path) == ["final"]
    with replacing_folder(final) as tmp:
        (tmp / "new.json").write_text("{}")
    assert os.listdir(final) == ["new.json"] and os.listdir(tmp_path) == ["final"]
