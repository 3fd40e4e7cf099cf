"""Where the commands read and write: the checkout this package runs from (its bench/results/
holds the measured rates some commands read) and the check of an output path before any work.
No torch: the command line imports it for its argument checks."""
from __future__ import annotations

import os

RESULTS = os.path.join("bench", "results")


def checkout_root() -> str | None:
    """The folder above this package when it holds bench/results/ (a clone, installed with
    ``pip install -e`` or on PYTHONPATH); None for an installed copy without one. Commands
    find their measured data here, whatever the working directory is."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.isdir(os.path.join(root, RESULTS)) else None


def checkout_file(*parts: str) -> str | None:
    """``checkout_root()/parts`` if that file exists, else None."""
    root = checkout_root()
    path = os.path.join(root, *parts) if root else None
    return path if path and os.path.isfile(path) else None


def output_path_error(path: str, folder: bool) -> str | None:
    """Why ``path`` cannot be written (a folder to create or fill when ``folder``, else a file
    to create or replace), or None when it can. Creates nothing: it looks at the path and its
    nearest existing ancestor, so a command can refuse a bad output before its work."""
    if not path:
        return "is empty"
    path = os.path.abspath(path)
    what = "folder" if folder else "file"
    if os.path.exists(path):
        if folder and not os.path.isdir(path):
            return f"{path} exists and is not a folder"
        if not folder and os.path.isdir(path):
            return f"{path} is a folder, not a file"
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            return f"{path} is not writable"
        return None
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot create the {what} {path}: {parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create the {what} {path}: {parent} is not writable"
    return None
