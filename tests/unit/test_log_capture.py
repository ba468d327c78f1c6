"""Ray's and Serve's log lines go to the run's file, not the terminal: stderr of this process and its children."""

from __future__ import annotations

import os
import subprocess
import sys

from baige_ray.ops.log_capture import stderr_to_file


def test_stderr_of_the_process_and_its_children_goes_to_the_file_and_comes_back(tmp_path, capfd):
    log = tmp_path / "run" / "ray.log"
    with stderr_to_file(log) as path:
        os.write(2, b"from the C++ core\n")
        subprocess.run([sys.executable, "-c", "import sys; print('from a raylet', file=sys.stderr)"], check=True)
        print("the demo's own line")
    os.write(2, b"after the block\n")
    assert path == log
    assert log.read_text().splitlines() == ["from the C++ core", "from a raylet"]
    out, err = capfd.readouterr()
    assert out == "the demo's own line\n" and err == "after the block\n"


def test_nothing_is_redirected_when_disabled(tmp_path, capfd):
    with stderr_to_file(tmp_path / "ray.log", enabled=False) as path:
        os.write(2, b"shown\n")
    assert path is None and not (tmp_path / "ray.log").exists()
    assert capfd.readouterr().err == "shown\n"
