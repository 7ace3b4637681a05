"""examples/chat_demo.py, the post-training demo data, as a user meets its errors."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO, run_script
from tests.prep.test_tool_errors import assert_one_line_exit_2

SCRIPT = REPO / "examples" / "chat_demo.py"


@pytest.mark.parametrize("valid", ["-3", "100000"])
def test_chat_demo_refuses_a_held_out_count_it_cannot_hold_out(tmp_path, valid):
    args = ["--output-dir", str(tmp_path / "demo"), "--valid", valid]
    proc = run_script(SCRIPT, args, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert_one_line_exit_2(proc, f"--valid {valid}")
    assert not (tmp_path / "demo").exists()
