"""Checkpoints that resume exactly, and fail loudly when corrupt or foreign.

Layout of one checkpoint (a directory, written under a temporary name and renamed into
place, so a crash mid-save never leaves a half checkpoint that looks whole):

    checkpoints/step_000050/
        model/               save_pretrained() output: weights, config, tokenizer
        trainer_state.pt     optimiser, scheduler, RNG states, step, data cursor
        manifest.json        sha256 of every file, step, config fingerprint, versions
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from graft_fed import __version__
from graft_fed.errors import CheckpointError

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder from `checkpoint_dirs` (`step_000040` -> 40)."""
    return int(path.name[len("step_"):])


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save_checkpoint(root: str | Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any],
                    fingerprint: str, keep: int, config: dict[str, Any] | None = None) -> Path:
    """`config`: the fingerprinted settings (TrainConfig.fingerprint_dict), recorded in the
    manifest so that a refused resume can name the settings that differ."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        (tmp / "model").mkdir(parents=True)
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(state, tmp / "trainer_state.pt")
        write_manifest(tmp, step, fingerprint, **({"config": config} if config is not None else {}))
    except OSError as exc:
        raise save_failed(tmp, root, step, exc) from exc
    return commit(tmp, root, step, keep)


def save_failed(tmp: Path, root: Path, step: int, exc: OSError) -> CheckpointError:
    """Remove the half-written `tmp` and say what failed and what is still there to resume from."""
    shutil.rmtree(tmp, ignore_errors=True)
    previous = checkpoint_dirs(root)
    where = f"the latest complete checkpoint, {previous[-1]}, is untouched" if previous else \
        "there is no earlier checkpoint"
    err = CheckpointError(f"could not write the checkpoint of step {step} under {root}: "
                          f"{exc.strerror or exc} ({exc.filename or tmp}); nothing half-written was kept and "
                          f"{where}. Free disk space (or lower run.keep_checkpoints) and resume.")
    err.errno = exc.errno  # type: ignore[attr-defined]
    return err


def write_manifest(tmp: Path, step: int, fingerprint: str, **extra: Any) -> None:
    """Record the sha256 of every file under `tmp` (a checkpoint being written)."""
    files = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"step": step, "fingerprint": fingerprint, "graft_fed_version": __version__,
                "torch_version": torch.__version__, **extra, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def commit(tmp: Path, root: Path, step: int, keep: int) -> Path:
    """Rename a fully written checkpoint into place and delete the oldest others so that `keep`
    remain. The checkpoint just written is never deleted, whatever the step numbers of the
    others (a run resumed from an earlier checkpoint than the latest)."""
    final = root / f"step_{step:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    others = [d for d in checkpoint_dirs(root) if d != final]
    for old in others[:max(0, len(others) - (max(1, keep) - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for key, value in d.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_difference(old: dict[str, Any], new: dict[str, Any], limit: int = 8) -> str:
    """The settings that differ, as "key: old -> new; ..." ("(default)" where one side does
    not record the key: fingerprints leave out some settings at their defaults)."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    diffs = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, missing), b.get(key, missing)
        if x != y and not (isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and list(x) == list(y)):
            show = [("(default)" if v is missing else json.dumps(v)) for v in (x, y)]
            diffs.append(f"{key}: {show[0]} -> {show[1]}")
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def verify_checkpoint(path: str | Path, fingerprint: str | None = None, config: dict[str, Any] | None = None,
                      recorded: Callable[[str], dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """Check a checkpoint's files against its manifest; return the manifest.

    `fingerprint`: refuse a checkpoint of another configuration; `config` (this run's
    fingerprinted settings) names the settings that differ, from the configuration the manifest
    records or, for a checkpoint written before manifests recorded it, from `recorded(its
    fingerprint)` (e.g. its run's config.json, when that still matches)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}); it was probably "
                              "interrupted while saving: resume from an earlier one or start afresh")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        files = manifest["files"]
        step = int(manifest["step"])
    except (KeyError, TypeError, ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise CheckpointError(f"{mpath} is unreadable ({type(exc).__name__}: {str(exc)[:200]}); the checkpoint is "
                              "corrupt: delete it and resume from an earlier one") from None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise CheckpointError(f"{mpath}: 'files' is not a map of file names to sha256 digests; the checkpoint is "
                              "corrupt: delete it and resume from an earlier one")
    for rel, digest in files.items():
        fpath = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"{mpath} lists {rel[:200]!r}, a file outside the checkpoint; the checkpoint is "
                                  "corrupt: delete it and resume from an earlier one")
        if not fpath.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {rel}; it is incomplete: delete it and "
                                  "resume from an earlier one")
        if _sha256(fpath) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {rel} does not match its recorded "
                                  "sha256; delete it and resume from an earlier one")
    if fingerprint is not None and manifest.get("fingerprint") != fingerprint:
        theirs = manifest.get("config")
        if not isinstance(theirs, dict) and recorded is not None:
            theirs = recorded(str(manifest.get("fingerprint")))
        diff = config_difference(theirs, config) if isinstance(theirs, dict) and config is not None else ""
        if diff:
            what = f"the checkpoint's -> this config's settings: {diff}"
        else:
            what = (f"fingerprint {manifest.get('fingerprint')} != {fingerprint}; the checkpoint does not record "
                    "its configuration (written before graft-fed recorded it), so the differing settings cannot "
                    "be named: compare with the config.json of the run that wrote it")
        raise CheckpointError(
            f"checkpoint {path} was written by a run with a different configuration ({what}); resume with the "
            "config it was trained with, or start a new run in another output_dir")
    manifest["step"] = step
    return manifest


def check_layout(path: str | Path, manifest: dict[str, Any], layout: str) -> None:
    """Refuse a checkpoint written by the other kind of run: "single" (one process,
    save_pretrained + trainer_state.pt) or "fsdp" (torchrun, sharded; see
    graft_fed/trainer/distributed.py)."""
    found = manifest.get("layout", "single")
    if found != layout:
        runs = {"single": "a single-process run (`graft-fed train`)", "fsdp": "a torchrun (FSDP2) run"}
        size = f" of {manifest['world_size']} processes" if found == "fsdp" and "world_size" in manifest else ""
        raise CheckpointError(
            f"checkpoint {path} was written by {runs.get(found, repr(found))}{size} and this is "
            f"{runs.get(layout, repr(layout))}: resume it the way it was trained, or start a new run "
            f"from its weights (model.path: {Path(path) / 'model'})")


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    try:
        return torch.load(Path(path) / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means the same thing here
        raise CheckpointError(f"cannot read {path}/trainer_state.pt: {exc}") from None


def set_aside_after(root: str | Path, step: int) -> list[Path]:
    """Move the checkpoints under `root` of steps after `step` into `root/abandoned/<UTC time>/`,
    where neither --resume nor pruning looks, and return where they went. A run resumed from
    an earlier checkpoint than its latest abandons the later ones: left in place, a later bare
    --resume would continue the abandoned line, and pruning would keep it over the new one.
    Nothing is deleted."""
    root = Path(root)
    later = [d for d in checkpoint_dirs(root) if checkpoint_step(d) > step]
    if not later:
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = root / "abandoned" / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = root / "abandoned" / f"{stamp}.{n}"
    dest.mkdir(parents=True)
    moved = []
    for d in later:
        os.replace(d, dest / d.name)
        moved.append(dest / d.name)
    return moved


#: What a distributed checkpoint's metadata (torch.distributed.checkpoint's `.metadata`, a
#: pickle) may name: its own dataclasses, tensor sizes, dtypes and layouts, paths. Anything
#: else (os.system, builtins.eval, ...) would run when dcp.load unpickles it.
_DCP_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")]
    + [("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")])


def check_dcp_metadata(path: str | Path) -> None:
    """Refuse a distributed checkpoint (the `dcp` folder of a torchrun checkpoint) whose
    metadata names anything but what torch.distributed.checkpoint writes: dcp.load unpickles
    it with plain pickle, so a checkpoint from elsewhere could run any code at resume. Call
    before dcp.load; raises CheckpointError."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in _DCP_METADATA_GLOBALS or (
                    module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"it names {module[:80]}.{name[:80]}, which a checkpoint's metadata never "
                                         "holds")

    from torch.distributed.checkpoint.metadata import Metadata

    try:
        files = sorted(p for p in Path(path).iterdir() if p.name.endswith(".metadata") and p.is_file())
    except OSError:
        files = []
    if not files:
        raise CheckpointError(f"{path} holds no .metadata: the checkpoint is incomplete; delete it and resume from "
                              "an earlier one")
    for meta in files:
        try:
            with meta.open("rb") as fh:
                value = Restricted(fh).load()
        except Exception as exc:  # noqa: BLE001 - any failure to unpickle means the same thing here
            raise CheckpointError(f"checkpoint metadata {meta} refused ({type(exc).__name__}: {str(exc)[:200]}); "
                                  "the checkpoint is corrupt or not one graft-fed wrote: delete it and resume from "
                                  "an earlier one") from None
        if meta.name == ".metadata" and not isinstance(value, Metadata):
            raise CheckpointError(f"checkpoint metadata {meta} holds a {type(value).__name__}, not a checkpoint's "
                                  "metadata; delete it and resume from an earlier one")


def latest_checkpoint(root: str | Path) -> Path | None:
    dirs = checkpoint_dirs(root)
    return dirs[-1] if dirs else None
