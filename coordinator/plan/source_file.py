"""The source checkpoint as seen at plan time, so a rewrite can be noticed.

Training often re-saves a checkpoint in place (`save_file` truncates and
rewrites the same path) while an earlier store of it is still running. The
identity below is taken when the store plans and checked again before every
byte range is sent; the node's digest check catches what slips between.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from smoltorrent.errors import SourceChangedError


@dataclass(frozen=True)
class SourceIdentity:
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> SourceIdentity:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SourceIdentity:
        return cls(**{k: int(data[k]) for k in ("size", "mtime_ns", "inode", "device")})

    def check(self, path: str | os.PathLike) -> None:
        """Raise SourceChangedError if the file at path is no longer these bytes."""
        try:
            now = SourceIdentity.of(path)
        except FileNotFoundError:
            raise SourceChangedError(
                f"{path} disappeared while it was being stored; the partial version was "
                "abandoned. Store it again once training has written it."
            ) from None
        if now != self:
            raise SourceChangedError(
                f"{path} was rewritten while it was being stored (size {self.size} -> "
                f"{now.size}); the partial version was abandoned so old and new bytes are "
                "never mixed. The new content is stored once the file is stable."
            )
