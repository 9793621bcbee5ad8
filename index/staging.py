"""One staged write: a new index is written aside, then built, given its model, saved and swapped in whole.

``build-index`` (a gallery re-embedded by another model), ``index rebuild`` and ``index merge`` write
their new index this way, so the directory they name holds either the old index or the new complete one,
with its model, whenever the process is killed. The staging copy is ``.NAME.staging`` beside the target
and belongs to one model: a killed write run again with the same model continues in it; one for another
model is thrown away. A staging copy in use carries ``STAGING_MARK`` until its commit: after the exchange of
a swap the staging name holds the old index, without it, so a kill there leaves an index that a write
which does not stage (``build-index`` with the index's own model) knows to remove (:func:`remove_leftover`),
while a staged write of the old index's model may continue from it, as from any copy of its model.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from index.gallery import GalleryIndex, ModelWriter
from index.manifest import MANIFEST_NAME, Manifest
from index.selection import IndexOptions

STAGING_MARK = ".staging"  # in a staging copy in use only: an index a swap moved to the staging name has none
_RENAME_EXCHANGE = 2  # renameat2's flag: swap two paths in one step (Linux 3.15+)
_AT_FDCWD = -100


def staging_directory(target: Path) -> Path:
    return target.parent / f".{target.name}.staging"


def remove_leftover(target: Path) -> None:
    """Remove what a kill after a swap's exchange left under ``target``'s staging name: the old index (no
    ``STAGING_MARK``). A staging copy being written is kept, for its model's next run."""
    staging = staging_directory(target)
    if staging.exists() and not (staging / STAGING_MARK).exists():
        shutil.rmtree(staging)


class StagedIndex:
    """The index being written aside; :meth:`commit` makes it the one at ``target``."""

    def __init__(self, target: Path, index: GalleryIndex) -> None:
        self.target = target
        self.index = index
        self.committed = False

    @property
    def directory(self) -> Path:
        return self.index.directory

    def commit(
        self,
        model: ModelWriter | None,
        *,
        options: IndexOptions | None = None,
        retune: bool = True,
        partitions: Sequence[np.ndarray] | None = None,
        progress: bool = False,
    ) -> bool:
        """Build the search structure, store ``model`` (None: the sources carried none), save, and swap the
        staging copy in for the target. ``options``, ``retune``: as ``GalleryIndex.build`` takes them.
        Returns whether the search structure was (re)built."""
        rebuilt = self.index.build(options, retune=retune, partitions=partitions, progress=progress)
        if model is not None:
            self.index.store_model(model)
        self.index.save()
        self.index.close()
        (self.directory / STAGING_MARK).unlink()  # a kill from here on leaves no copy to continue
        swap_in(self.directory, self.target)
        self.committed = True
        return rebuilt

    def discard(self) -> None:
        """Throw the staging copy away (nothing in it is worth continuing)."""
        self.index.close()
        shutil.rmtree(self.directory)
        self.committed = True  # nothing left to close


@contextmanager
def staged_write(
    target: Path, *, fingerprint: str, create: Callable[[Path], GalleryIndex], resume: bool = True
) -> Iterator[StagedIndex]:
    """The staging copy for ``target``: an interrupted one of the model ``fingerprint`` when ``resume``,
    else a fresh one made by ``create``. Leaving the block without committing keeps it for the next run
    when ``resume`` and removes it otherwise."""
    staging = staging_directory(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = StagedIndex(target, _open_or_create(staging, fingerprint, create, resume))
    try:
        yield staged
    finally:
        if not staged.committed:
            staged.index.close()
            if not resume:
                shutil.rmtree(staging, ignore_errors=True)


def _open_or_create(
    staging: Path, fingerprint: str, create: Callable[[Path], GalleryIndex], resume: bool
) -> GalleryIndex:
    resumable = resume and (staging / MANIFEST_NAME).exists()
    if resumable and Manifest.load(staging).model_fingerprint == fingerprint:
        index = GalleryIndex.open(staging)
    else:
        if staging.exists():  # another model's, killed before its manifest was written, or not to resume
            shutil.rmtree(staging)
        index = create(staging)
    (staging / STAGING_MARK).touch()
    return index


def swap_in(source: Path, target: Path) -> None:
    """Put the complete directory ``source`` at ``target`` in one step, then remove what was there.

    With renameat2's exchange the target always names a whole index (the old one, then the new one);
    where the system has no exchange, the old one is moved away first and the new one renamed in.
    """
    if not target.exists():
        os.replace(source, target)
    elif _exchange(source, target):
        shutil.rmtree(source)  # now the old index
    else:
        old = target.parent / f".{target.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(source, target)
        shutil.rmtree(old)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically; False where the system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))
