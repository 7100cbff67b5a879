"""Lightning's checkpoints onto a smoltorrent cluster: a CheckpointIO plugin.

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from smoltorrent.integrations.lightning import CheckpointIO

    io = CheckpointIO("run1")
    io.restore("checkpoints")  # pointers to what the cluster holds, on a fresh machine
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint("checkpoints", save_last=True)])
    trainer.fit(model, ckpt_path="last")

Lightning hands the plugin a checkpoint dict (the LightningModule's state_dict, optimizer
and scheduler states, loop progress, callback states, plain values) and a path. The dict
is stored with smoltorrent.save, as a nested state (smoltorrent/keypaths.py): tensors
under key paths in a .safetensors file, everything else as JSON in its header. Nothing is
pickled, and nothing runs on load; a value that is neither a tensor, a container nor a
plain value (a module or a function in hyper_parameters) is refused (StateDictError).

A save runs in the background, as smoltorrent.save(wait=False) does: save_checkpoint
returns once the checkpoint is snapshotted and journalled, and the store goes on in the
save's writer process. wait=True makes each save wait for its commit instead.

Lightning path -> smoltorrent name: PREFIX + "/" + the path relative to `root` (the
working directory when the plugin was made), with "/" between its parts:
`checkpoints/last.ckpt` under CheckpointIO("run1") is `run1/checkpoints/last.ckpt`.
Saving a path again (`last.ckpt`, every epoch) makes a new version of its name; the
tensors that did not change are not sent again.

At the path itself the plugin writes a pointer: a few lines of JSON naming the name and
the version id it saved, written once that version is committed (by a thread of the
plugin's, in the order of the saves; loading or removing a path waits for its pointer,
and teardown, at the end of fit, for every one). Lightning decides what
exists by looking at its checkpoint directory, not by asking the plugin: ModelCheckpoint
lists it for `ckpt_path="last"` (the newest `last*.ckpt` by modification time), checks a
path before reusing its name, and links `last.ckpt` to the newest checkpoint with
save_last="link". The pointers make all of that work unchanged, and a pointer read back
loads exactly the version it names. A path with no pointer (a fresh machine) loads the
current version of its name; `restore(dirpath)` writes the pointers of the checkpoints
the cluster holds under a directory, so `ckpt_path="last"` finds them there too.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO

import smoltorrent
from smoltorrent import defaults, durable
from smoltorrent.errors import CheckpointFormatError, SmoltorrentError

if TYPE_CHECKING:
    from smoltorrent.api import SaveHandle

log = logging.getLogger("smoltorrent")

POINTER_KIND = "smoltorrent lightning checkpoint"  # what a pointer file says it is
POINTER_FORMAT = 1  # of the pointer's JSON; a reader refuses a newer one


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's CheckpointIO: checkpoints saved to and loaded from the cluster.

    prefix: the smoltorrent name every checkpoint path is stored under (a run's name).
    root: the directory paths are taken relative to (default: the working directory now).
    replicas, staging_dir, bwlimit: as smoltorrent.save and smoltorrent.load take them.
    wait: each save waits for its commit (default: it returns once journalled, as
    smoltorrent.save(wait=False) does, and its pointer is written at the commit)."""

    def __init__(
        self,
        prefix: str,
        *,
        root: str | os.PathLike[str] | None = None,
        replicas: int = defaults.DEFAULT_REPLICAS,
        staging_dir: str | os.PathLike[str] | None = None,
        bwlimit: int | None = None,
        wait: bool = False,
    ) -> None:
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise SmoltorrentError(f"a prefix is a non-empty name (a run's), not {prefix!r}")
        self.prefix = prefix.strip("/")
        self.root = Path(os.path.abspath(root if root is not None else os.getcwd()))
        self.replicas = replicas
        self.staging_dir = staging_dir
        self.bwlimit = bwlimit
        self.wait = wait
        self._pointing: dict[Path, Future[None]] = {}  # a path's pointer, until written
        # One thread: the pointers are written in the order of their saves.
        self._pointers: ThreadPoolExecutor | None = None

    def name_of(self, path: str | os.PathLike[str]) -> str:
        """The smoltorrent name a Lightning path is stored under."""
        absolute = Path(os.path.abspath(path))  # not resolved: last.ckpt may be a link
        try:
            relative = absolute.relative_to(self.root)
        except ValueError:
            raise SmoltorrentError(
                f"the checkpoint path {str(path)!r} is outside {self.root}, the root its name "
                "is taken from: give CheckpointIO(..., root=) a directory above it"
            ) from None
        return "/".join((self.prefix, *relative.parts))

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Store `checkpoint` as a version of the path's name; once it is committed, write
        the path's pointer to that version (in the background unless `wait`)."""
        if storage_options is not None:
            raise TypeError(  # as Lightning's TorchCheckpointIO refuses them
                f"smoltorrent's CheckpointIO takes no storage_options (got {storage_options!r});"
                " give replicas= or bwlimit= to CheckpointIO(...)"
            )
        name = self.name_of(path)
        handle = smoltorrent.save(
            checkpoint,
            name,
            replicas=self.replicas,
            wait=False,
            staging_dir=self.staging_dir,
            bwlimit=self.bwlimit,
        )
        if self.wait:
            write_pointer(Path(path), name, handle.version_id)
            return
        if self._pointers is None:
            self._pointers = ThreadPoolExecutor(1, thread_name_prefix="smoltorrent-pointers")
        key = Path(os.path.abspath(path))
        self._pointing[key] = self._pointers.submit(_point, key, name, handle)

    def _settle(self, path: str | os.PathLike[str] | None = None) -> list[BaseException]:
        """Wait for the pointer of `path` (every one when None) to be written; what kept
        any from being written (its save failed)."""
        keys = list(self._pointing) if path is None else [Path(os.path.abspath(path))]
        failed = []
        for key in keys:
            future = self._pointing.pop(key, None)
            if future is not None and future.exception() is not None:
                failed.append(future.exception())
        return failed

    def teardown(self) -> None:
        """At the end of fit: every save's pointer written; SmoltorrentError naming the
        saves that failed (each was logged as it did; training is over)."""
        failed = self._settle()
        if self._pointers is not None:
            self._pointers.shutdown()
            self._pointers = None
        if failed:
            raise SmoltorrentError(
                f"{len(failed)} checkpoint save(s) failed: " + "; ".join(map(str, failed))
            )

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint the path's pointer names or, with no file at the path, the
        current version of its name. weights_only changes nothing: no load runs code."""
        if map_location is not None and not isinstance(map_location, str):
            import torch

            if not isinstance(map_location, torch.device):
                raise TypeError(
                    "smoltorrent's CheckpointIO loads onto one device: map_location is a "
                    f"str or a torch.device, not {map_location!r}"
                )
        self._settle(path)
        if os.path.exists(path):
            name, version = read_pointer(Path(path))
        else:
            name, version = self.name_of(path), None
        return smoltorrent.load(
            name,
            version=version,
            device=None if map_location is None else str(map_location),
            staging_dir=self.staging_dir,
            bwlimit=self.bwlimit,
        )

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the path's pointer and, unless the path is only a link to another
        checkpoint (save_last="link"), the versions of its name (pinned ones stay). The
        removal is sent to the cluster's worker, not waited for: ModelCheckpoint removes
        the checkpoint a newer one replaced, in the training step."""
        self._settle(path)  # a save of it in flight: its pointer, then the removal
        path = Path(path)
        if path.is_symlink():
            path.unlink()
            return
        name = self.name_of(path)
        path.unlink(missing_ok=True)
        remove_versions(name)

    def restore(self, dirpath: str | os.PathLike[str]) -> list[Path]:
        """Write the pointer of every checkpoint the cluster holds under `dirpath` (its
        name's current version) that has no file there yet, dated when that version was
        made, so ModelCheckpoint and `ckpt_path="last"` find them; the pointers written."""
        from coordinator.state.versions import COMMITTED
        from tasks.context import metadata

        directory = Path(os.path.abspath(dirpath))
        under = self.name_of(directory) + "/"
        md = metadata()
        written = []
        for name in md.versions.names():
            if not name.startswith(under) or "/" in name[len(under) :]:
                continue
            vkey = md.versions.current(name)
            if vkey is None or md.versions.state(vkey) != COMMITTED:
                continue
            path = directory / name[len(under) :]
            if os.path.lexists(path):
                continue
            version = md.versions.version(vkey)
            write_pointer(path, name, version["version_id"])
            made = float(version.get("created_at") or 0)
            if made:
                os.utime(path, (made, made))
            written.append(path)
        return written


def _point(path: Path, name: str, handle: SaveHandle) -> None:
    """Once the save commits, the path's pointer to it; a failed save logged."""
    try:
        version_id = handle.version_id
    except Exception as exc:
        log.warning("smoltorrent: the save of %s failed (%s); no pointer at %s", name, exc, path)
        raise
    write_pointer(path, name, version_id)


def write_pointer(path: Path, name: str, version_id: str) -> None:
    """The pointer at `path` to `name`'s version `version_id`, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"kind": POINTER_KIND, "format": POINTER_FORMAT, "name": name, "version": version_id}
    durable.replace_file(path, (json.dumps(body, indent=1) + "\n").encode())


def read_pointer(path: Path) -> tuple[str, str]:
    """(name, version id) of the pointer at `path`; CheckpointFormatError for any other
    file (a checkpoint Lightning wrote itself, a pickle: never unpickled here)."""
    with open(path, "rb") as f:
        # A pointer is JSON: a file that does not start as one is not read further (a
        # Lightning checkpoint written by torch.save can be gigabytes).
        try:
            body = json.loads(f.read()) if f.read(1) == b"{" and f.seek(0) == 0 else None
        except ValueError:
            body = None
    if not isinstance(body, dict) or body.get("kind") != POINTER_KIND:
        raise CheckpointFormatError(
            f"{path} is not a smoltorrent pointer: a checkpoint written without the "
            "smoltorrent CheckpointIO (torch.save's pickle); load it with Lightning's own "
            "TorchCheckpointIO, or give the plugin a path it saved"
        )
    if body.get("format", 0) > POINTER_FORMAT:
        raise CheckpointFormatError(
            f"{path} was written by a newer smoltorrent (pointer format {body['format']}); "
            "upgrade smoltorrent to load it"
        )
    return body["name"], body["version"]


def remove_versions(name: str) -> None:
    """Send the removal of every version of `name` but the pinned ones to the worker."""
    from coordinator import config
    from tasks.context import metadata
    from tasks.remove import remove

    md = metadata()
    vkeys = md.versions.versions(name)
    pinned = {v for v, (pin, _) in md.versions.labels(vkeys).items() if pin}
    for vkey in vkeys:
        if vkey not in pinned:
            remove.apply_async(args=(vkey,), queue=config.CONTROL_QUEUE, argsrepr=name)
