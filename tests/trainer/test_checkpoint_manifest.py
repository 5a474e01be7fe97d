"""A checkpoint's manifest.json that is not what graft-fed writes (a damaged or hand-edited
file, a checkpoint from elsewhere) is a CheckpointError that says what to do, never a
traceback, and names no file outside the checkpoint."""

import json

import pytest

from graft_fed.errors import CheckpointError
from graft_fed.trainer import checkpoint as ckpt


@pytest.mark.parametrize("manifest, message", [
    ({"step": 1, "files": ["model/model.safetensors"]}, "'files' is not a map"),
    ({"step": 1, "files": {"trainer_state.pt": 7}}, "'files' is not a map"),
    ({"step": 1, "files": {"/etc/hostname": "0" * 64}}, "outside the checkpoint"),
    ({"step": 1, "files": {"../../secret": "0" * 64}}, "outside the checkpoint"),
    ([1, 2], "unreadable"),
    ("[" * 100_000, "unreadable"),
])
def test_a_malformed_checkpoint_manifest_is_a_checkpoint_error(manifest, message, tmp_path):
    path = tmp_path / "step_000001"
    path.mkdir()
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (path / ckpt.MANIFEST).write_text(text, encoding="utf-8")
    with pytest.raises(CheckpointError, match=message):
        ckpt.verify_checkpoint(path, "fp")


def test_a_manifest_that_is_not_utf8_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "step_000001"
    path.mkdir()
    (path / ckpt.MANIFEST).write_bytes(b'{"step": 1, "files": {}}\xff')
    with pytest.raises(CheckpointError, match="unreadable"):
        ckpt.verify_checkpoint(path, "fp")
