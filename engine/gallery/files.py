"""Which files of a gallery folder are its images, and the whole symlink rule for them.

- Listing (:func:`list_images`) follows a linked folder that leads outside the gallery (training sets are
  often class folders linked in from elsewhere), but not one that leads inside it or back above itself.
- A file is indexed and served only when it resolves, links and ".." followed, inside the gallery
  (:func:`resolves_inside`): the server would otherwise show any file of the machine a link leads to.
- New images are written into, and their abandoned temporary files cleared from, the gallery's own label
  folders only, never through a link (:func:`is_writable_folder`, :func:`own_folders`).
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.decode.images import IMAGE_SUFFIXES, image_header
from foundation.defaults import TRASH_FOLDER


def resolves_inside(path: Path, root: Path) -> bool:
    """Whether ``path``, its links and ".." followed, lies inside ``root`` (itself resolved)."""
    return path.resolve().is_relative_to(root.resolve())


def own_folders(root: Path) -> list[Path]:
    """The folders directly in ``root`` that are its own: linked folders left out. Raises ``OSError``."""
    return [path for path in root.iterdir() if path.is_dir() and not path.is_symlink()]


def is_writable_folder(folder: Path) -> bool:
    """Whether new files may be written in ``folder``: absent, or a real folder, never a link (it could lead
    anywhere) nor a file."""
    return not folder.is_symlink() and (folder.is_dir() or not folder.exists())


def is_image_file(path: Path) -> bool:
    """Whether a gallery file is an image: by a known suffix, else by its header (Pillow's sniffing).

    Hidden files without an image suffix are not sniffed: they are atomic writes' temporary files.
    """
    if not path.is_file():
        return False
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return True
    if path.name.startswith("."):
        return False
    with image_header(path) as image:
        return image is not None


def in_trash(path: Path, root: Path) -> bool:
    """Whether ``path`` lies in the trash of the gallery ``root`` (``TRASH_FOLDER`` at its top), which is
    never part of the gallery."""
    return path.is_relative_to(root / TRASH_FOLDER)


def list_images(root: Path) -> list[Path]:
    """All image files below ``root`` (see :func:`is_image_file`), sorted for a deterministic order.

    A linked folder is followed when it leads outside ``root`` (training sets are often class folders
    linked in from elsewhere); one that leads to a folder inside ``root`` is not, as its files are listed
    at their own paths already (an alias would claim them, and name their label), nor is one that leads
    back to a folder above it, which would never end; nor is the trash that duplicate plans move images
    to (``TRASH_FOLDER`` at the top). Whether a file outside ``root`` may be indexed is
    the caller's call: build-index skips, and lists, those.
    """
    found: list[Path] = []
    top = os.fspath(root)
    inside = os.path.realpath(top)
    # Each walked folder's real path and those of the folders above it: a link to one of them is a loop.
    above: dict[str, frozenset[str]] = {}
    for folder, subfolders, names in os.walk(top, followlinks=True):
        real, parents = os.path.realpath(folder), above.get(os.path.dirname(folder), frozenset())
        alias = folder != top and os.path.islink(folder) and Path(real).is_relative_to(inside)
        if alias or real in parents:
            subfolders.clear()
            continue
        above[folder] = parents | {real}
        if folder == top and TRASH_FOLDER in subfolders:
            subfolders.remove(TRASH_FOLDER)
        found.extend(path for path in (Path(folder, name) for name in names) if is_image_file(path))
    return sorted(found)
