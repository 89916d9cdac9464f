"""pass_rate.py on a throwaway test file: every run counted, the loaded ones too, and the
recorded quantity's range printed."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("pass_rate.py")
TESTS = """
def test_records(record_property):
    record_property("value", 0.5)

def test_fails():
    assert False, "always"
"""


def test_counts_passes_idle_and_loaded_and_the_recorded_range(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    command = [sys.executable, str(SCRIPT), str(tmp_path / "test_sample.py"), "--runs", "2"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "run 2/2 (loaded" in out.stdout and "run 1/2 (idle" in out.stdout
    assert "passed 2/2 (1/1 under load)" in out.stdout
    assert "passed 0/2 (0/1 under load)" in out.stdout and "always" in out.stdout
    assert "value: 0.5 .. 0.5 over 2 runs" in out.stdout
