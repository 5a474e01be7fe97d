"""`pip install 'graft-fed[vllm]'` keeps the torch and transformers the project runs on.

This test asks the package index (PyPI in CI). pip resolves, without installing or
downloading any wheel (`--dry-run --report`; the index serves each wheel's metadata on
its own, so this takes seconds, not the GBs of vLLM's and torch's CUDA wheels), the
project's dependencies with its `vllm` extra, as a user's `pip install` would. vLLM pins
torch exactly and recent releases cap transformers, so the extra's range decides which
torch and transformers come with it. The resolution must keep:

* torch at the release scripts/setup.sh installs (vLLM's pin must be that release);
* transformers at least at the release installed here (the one the project is developed
  and tested on): a vLLM whose cap forces an older one is outside the supported range.

A failure names the versions pip chose, or pip's conflict. The test skips, saying so, only
where no index can be reached or where vLLM publishes no wheels (not Linux).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python >= 3.11)")

ROOT = Path(__file__).resolve().parents[2]
_OFFLINE = re.compile(r"NewConnectionError|Failed to establish|Temporary failure in name resolution|"
                      r"Network is unreachable|Max retries exceeded|ConnectTimeout|ProxyError")


def setup_torch() -> str:
    """The torch release scripts/setup.sh installs (its CPU build; the CUDA build of the same
    release has the same version without the local tag)."""
    found = set(re.findall(r'"torch==([0-9][0-9.]*)"', (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")))
    assert len(found) == 1, f"scripts/setup.sh should pin exactly one torch release, found {sorted(found)}"
    return found.pop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vLLM publishes wheels for Linux only")
def test_vllm_extra_keeps_the_projects_torch_and_transformers(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (extra,) = project["optional-dependencies"]["vllm"]
    torch_release = setup_torch()
    developed_on = Version(Version(transformers.__version__).base_version)
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "--report", str(report), *project["dependencies"], extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        if _OFFLINE.search(done.stderr) and "ResolutionImpossible" not in done.stderr:
            pytest.skip(f"no package index reachable: {done.stderr.strip().splitlines()[-1]}")
        said = [line for line in done.stderr.splitlines() if "WARNING: Location" not in line]
        pytest.fail(f"the project with its vllm extra {extra!r} does not resolve; pip said:\n" + "\n".join(said[-25:]))
    resolved = {item["metadata"]["name"].lower(): Version(item["metadata"]["version"])
                for item in json.loads(report.read_text())["install"]}
    chose = (f"pip chose vllm {resolved['vllm']}, torch {resolved['torch']}, "
             f"transformers {resolved['transformers']}")
    print(chose)
    assert resolved["vllm"] in Requirement(extra).specifier, chose
    assert resolved["torch"].base_version == torch_release, (
        f"{chose}: that vLLM pins a torch other than the {torch_release} scripts/setup.sh installs; "
        "narrow the vllm range in pyproject.toml (and docs/scaling.md's table) or move setup.sh's torch")
    assert Version(resolved["transformers"].base_version) >= developed_on, (
        f"{chose}: that vLLM caps transformers below the {developed_on} the project runs on; "
        "narrow the vllm range in pyproject.toml (and docs/scaling.md's table)")
