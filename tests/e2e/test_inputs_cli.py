"""The CLI (no launcher) reports a reward file without reward_func as one line, exit 2, no traceback."""

import subprocess
import sys

from tests.distributed import ROOT


def test_cli_reports_errors_without_a_traceback(tmp_path):
    bad = tmp_path / "r.py"
    bad.write_text("x = 1\n")
    proc = subprocess.run([sys.executable, "-m", "rlhf.cli.train_ppo", "--remote_rm_url", str(bad),
                           "--prompt_max_len", "16", "--generate_max_len", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "defines no function reward_func" in proc.stderr
    assert "Traceback" not in proc.stderr
