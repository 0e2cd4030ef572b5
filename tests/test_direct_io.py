"""checkpoint/direct_io.py: files written past the page cache are byte for byte what a buffered write gives, hashed
on the way out, on filesystems with O_DIRECT and without it."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch


@pytest.mark.parametrize("o_direct", ["taken", "refused"])
def test_direct_file_writes_what_torch_save_writes_and_hashes_it(o_direct, tmp_path, monkeypatch):
    """torch.save through `DirectFile` (a buffer of 64 KiB, so files span several writes and end mid-block) gives the
    bytes torch.save gives a buffered file, and its digest equals the manifest's hash of the file read back; where
    the filesystem refuses O_DIRECT (as tmpfs did before Linux 6.6), the same through the page cache; an empty file
    stays empty."""
    from checkpoint.direct_io import BLOCK, DirectFile
    from checkpoint.hashing import new_digest
    from checkpoint.layer_files import unchecked_zip_records
    from checkpoint.manifest import file_hash

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    if o_direct == "refused":
        real_open = os.open

        def refusing_open(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", refusing_open)
    for n in (0, 1, 1000, 50_000):  # tensor elements: files of a few hundred bytes to several buffers
        state = {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
        expected = io.BytesIO()
        with unchecked_zip_records():
            torch.save(state, expected)
            digest = new_digest()
            with DirectFile(str(tmp_path / f"f{n}.pt"), digest, fsync=True, buffer=64 * 1024) as f:
                torch.save(state, f)
                assert f.direct == (o_direct == "taken")
        data = (tmp_path / f"f{n}.pt").read_bytes()
        assert data == expected.getvalue() and len(data) % BLOCK != 0
        assert digest.hexdigest() == file_hash(str(tmp_path / f"f{n}.pt"))
    with DirectFile(str(tmp_path / "empty"), new_digest()):
        pass
    assert (tmp_path / "empty").read_bytes() == b""


def test_a_failed_write_is_raised_every_time_and_the_file_closed(tmp_path, monkeypatch):
    """A write that fails in the writing thread (a full disk) is raised by the caller's next write and again by
    every later one and the close, so torch.save (which writes its end of file after an error) raises that error
    and not one of its own; the file descriptor and the thread are released."""
    import checkpoint.direct_io as direct_io

    real_write, opened = os.write, []

    def full_disk(fd, data):
        if fd in opened:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    for size in (10, 3 * 64 * 1024):  # the error met at close, and by a later write
        f = direct_io.DirectFile(str(tmp_path / f"f{size}"), buffer=64 * 1024)
        opened.append(f.fd)
        with pytest.raises(OSError, match="No space left"):
            with f:
                torch.save({"x": torch.zeros(size // 4 + 1)}, f)
        assert f.fd == -1
        with pytest.raises(OSError):
            os.fstat(opened[-1])


def test_a_filesystem_that_opens_with_o_direct_but_refuses_its_writes_gets_buffered_writes(tmp_path, monkeypatch):
    """Where O_DIRECT is taken at the open but a write fails with EINVAL (some FUSE and SMB clients), the flag is
    cleared on the descriptor and the same bytes are written through the page cache; the file is whole."""
    import fcntl

    from checkpoint.direct_io import DirectFile

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_write = os.write

    def refusing(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refusing)
    data = bytes(range(256)) * 1000  # 256,000 bytes: three buffers and a tail
    with DirectFile(str(tmp_path / "f"), buffer=64 * 1024) as f:
        f.write(data)
    assert (tmp_path / "f").read_bytes() == data and not f.direct
