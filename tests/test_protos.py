import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_current():
    proc = subprocess.run(["bash", "scripts/gen_protos.sh", "--check"], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_only_the_transport_modules_import_generated_code():
    allowed = {"graft_fed/broker/servicer.py", "graft_fed/broker/server.py", "graft_fed/node/client.py",
               "graft_fed/federation/codec.py"}
    offenders = []
    for path in (ROOT / "graft_fed").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("graft_fed/proto/"):
            continue
        if "graft_fed.proto" in path.read_text(encoding="utf-8") and rel not in allowed:
            offenders.append(rel)
    assert not offenders, offenders
