"""checkpoint/read_ahead.py: the thread that reads what conversion and export will need next into the page cache."""

from __future__ import annotations

import os
from pathlib import Path


def test_read_ahead_reads_the_ranges_in_order_within_its_distance(tmp_path, hf_models, monkeypatch):
    """The thread stops `ahead` bytes (whole ranges of at most a chunk here) past the range the caller reached, goes
    on when told, stops quietly at a missing file; conversion's reader asks it for exactly the tensors it reads."""
    import time

    import checkpoint.hf_reader as hf_reader
    from checkpoint.read_ahead import ReadAhead, whole_files

    mib = 2**20
    paths = [str(tmp_path / f"f{i}") for i in range(4)]
    for path in paths:
        Path(path).write_bytes(b"x" * 3 * mib)

    def settled(ahead, want):
        for _ in range(500):
            if ahead.position == want:
                return time.sleep(0.05) or ahead.position
            time.sleep(0.01)
        return ahead.position

    with ReadAhead(whole_files(paths + [str(tmp_path / "missing"), paths[0]]), ahead=4 * mib) as ahead:
        assert settled(ahead, 6 * mib) == 6 * mib  # range 1 began before 4 MiB, none after it
        ahead.reached(2)
        assert settled(ahead, 12 * mib) == 12 * mib  # then the missing file: stopped, nothing raised
    seen, reached = [], []

    class Spy(ReadAhead):
        def __init__(self, ranges, *args):
            seen.extend(ranges)
            super().__init__(ranges, *args)

        def reached(self, index):
            reached.append(index)

    monkeypatch.setattr(hf_reader, "ReadAhead", Spy)
    want = []
    for name, _, shard in hf_reader.iter_tensors(hf_models["gqa"]):
        path = os.path.join(hf_models["gqa"], shard)
        start, header = hf_reader.read_safetensors_header(path)
        want.append((path, *(start + offset for offset in header[name]["data_offsets"])))
    assert seen == want and reached == list(range(1, len(want) + 1))
