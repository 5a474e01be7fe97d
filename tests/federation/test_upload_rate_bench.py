"""bench/broker/upload_rate.py at a tiny size, so the small-uploads benchmark cannot rot:
2 nodes x 3 bundles of 4 KiB through the broker and through raw gRPC, every bundle stored
once, the heartbeat probe answered, results written."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_upload_rate_bench_stores_every_bundle(tmp_path):
    args = ["--nodes", "2", "--prompts", "3", "--kib", "4", "--timeout-s", "60", "--out-dir", str(tmp_path),
            "--name", "tiny"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "broker" / "upload_rate.py"), *args],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "tiny.json").read_text())
    assert res["stored"] == 6 and res["servicer"]["UploadBundle"]["count"] == 6
    assert res["servicer"]["HasBundles"]["count"] == 2
    assert res["broker_bundles_per_s"] > 0 and res["raw_bundles_per_s"] > 0 and res["ratio"] > 0
    assert "| 2 | 3 |" in (tmp_path / "tiny.md").read_text()
