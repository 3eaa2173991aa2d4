"""Engine-core socket folders of dead processes are removed at the next launch (issue 53,
point 7); those of live processes, and those still listened on, are kept."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

import pytest

from kvpush.engine import core_dir

pytestmark = pytest.mark.timeout(30)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_folders_of_dead_processes_go_at_the_next_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _dead_pid()
    stale = tmp_path / f"kvpush-core-{dead}-abc123"
    stale.mkdir(mode=0o700)
    (stale / "in").touch()  # a socket file nobody listens on any more
    live = tmp_path / f"kvpush-core-{os.getpid()}-def456"
    live.mkdir(mode=0o700)
    listened = tmp_path / f"kvpush-core-{dead}-ghi789"  # pid of another namespace?
    listened.mkdir(mode=0o700)
    other = tmp_path / "kvpush-core-old1234x"  # no pid in its name: not ours to judge
    other.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(listened / "in"))
        srv.listen(1)
        made = core_dir.make_core_dir()
        assert core_dir.remove_stale() == []  # nothing else is stale, our new one lives
    assert not stale.exists()
    assert live.exists() and listened.exists() and other.exists()
    assert os.path.dirname(made) == str(tmp_path)
    assert os.path.basename(made).startswith(f"kvpush-core-{os.getpid()}-")
    assert os.stat(made).st_mode & 0o777 == 0o700
    assert core_dir.remove_stale() == [str(listened)]  # nobody listens there now
