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


def test_a_distributed_checkpoint_whose_metadata_would_run_code_is_refused(tmp_path):
    """torch.distributed.checkpoint keeps its metadata as a plain pickle and dcp.load
    unpickles it: a torchrun checkpoint from elsewhere ran any code at resume (here it would
    create a file). Its metadata is read with only checkpoint classes allowed first."""
    import os
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    honest = tmp_path / "honest"
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    dcp.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=honest)
    ckpt.check_dcp_metadata(honest)  # what torch writes passes

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="names posix.system|names os.system"):
        ckpt.check_dcp_metadata(evil)
    assert not marker.exists()
    (evil / ".metadata").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="not a checkpoint's metadata"):
        ckpt.check_dcp_metadata(evil)
    (evil / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="holds no .metadata"):
        ckpt.check_dcp_metadata(evil)
