"""Packaging and setup paths that only break from a fresh clone: the license field form the
build backend keeps supporting, a bounded backend, the TRL benchmark's venv check, and a
closed stdout pipe."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_an_spdx_string_and_the_build_backend_is_bounded():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert data["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert re.fullmatch(r"setuptools>=(\d+)(\.\d+)*,<(\d+)", setuptools), setuptools
    assert int(setuptools.split(">=")[1].split(".")[0].split(",")[0]) >= 77  # PEP 639 license strings


def _setup_venv_check() -> str:
    """The condition bench/step_time/setup_venv.sh tests before installing graft-fed."""
    text = (ROOT / "bench" / "step_time" / "setup_venv.sh").read_text(encoding="utf-8")
    (line,) = [x for x in text.splitlines() if x.startswith("if ! ") and "graft-fed" in x]
    return line[len("if ! "):].rsplit(";", 1)[0].strip()


def test_trl_venv_check_installs_graft_fed_even_when_run_from_the_repo_root(tmp_path):
    """From the repo root `import graft_fed` succeeds through the current directory in any
    Python; the check must ask the venv whether graft-fed (and math-verify) are installed."""
    check = _setup_venv_check()
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    run = lambda venv: subprocess.run(["bash", "-c", check], cwd=ROOT, env={**os.environ, "VENV": str(venv)},
                                      capture_output=True, timeout=120)
    assert run(bare).returncode != 0, "a venv without graft-fed must be found wanting (so setup installs it)"
    here = Path(sys.executable).parent.parent  # this test's environment has graft-fed and math-verify
    assert run(here).returncode == 0


def test_a_closed_stdout_pipe_ends_quietly(tmp_path):
    allowlist = tmp_path / "allow.yaml"
    allowlist.write_text(yaml.safe_dump({"allowed": [f"node-{i:05d}" for i in range(20000)]}))
    proc = subprocess.Popen([sys.executable, "-m", "graft_fed.cli", "broker", "nodes", "list", "--allowlist",
                             str(allowlist)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"allowed")
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
