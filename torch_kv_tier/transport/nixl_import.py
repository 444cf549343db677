"""Importing NIXL's Python API without importing torch where torch could not change the choice.

``import nixl`` (the meta package) picks its backend wheel (``nixl_cu13``, ``nixl_cu12``,
``nixl_rocm``) from the CUDA major version ``nixl_meta_utils.detect_cuda_major`` finds: from a
CUDA stack already imported, else from torch's ``version.py`` read off disk, else, as a last
resort, by importing torch (~1.2 s of CPU) to read ``torch.version.cuda``. On a CPU-only torch
build the file says ``cuda = None``, so the last resort imports torch only to be told the same
``None``. ``import_nixl_api`` reads that file first and, where it says ``None`` and no CUDA stack
is loaded, imports the meta package with the detection answering ``None`` directly: the backend
chosen is the one ``import nixl`` chooses, torch stays unimported. Everywhere else (torch
already imported, a CUDA torch build, no torch, an unreadable file, a NIXL without the meta
package) it is a plain ``import nixl._api``.

Threading: safe from any thread; the first import is serialized by ``_LOCK``. While it runs,
``detect_cuda_major`` answers ``None`` to any caller (``nixl_ep``'s too): the answer it gives then.
"""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

_LOCK = threading.Lock()
# what ``detect_cuda_major`` reads before torch's file: a loaded stack answers for itself
_CUDA_STACKS = ("torch", "cuda.bindings", "cupy")


def import_nixl_api() -> ModuleType:
    """``nixl._api``, imported as ``import nixl._api`` would, without importing torch on a
    CPU-only torch build. Raises the ``ImportError`` that import raises."""
    with _LOCK:
        if "nixl._api" in sys.modules or not _torch_has_no_cuda():
            return importlib.import_module("nixl._api")
        try:
            meta: Any = importlib.import_module("nixl_meta_utils")
        except ImportError:  # a NIXL without the meta package: nothing detects anything
            return importlib.import_module("nixl._api")
        detect = getattr(meta, "detect_cuda_major", None)
        if detect is None:  # another NIXL's detection: left to itself
            return importlib.import_module("nixl._api")
        meta.detect_cuda_major = _no_cuda  # the meta package binds it on import, below
        try:
            return importlib.import_module("nixl._api")
        finally:
            meta.detect_cuda_major = detect


def _no_cuda() -> None:
    """``detect_cuda_major``'s answer where ``_torch_has_no_cuda`` holds."""
    return None


def _torch_has_no_cuda() -> bool:
    """Whether torch is installed, not imported, and its ``version.py`` says ``cuda = None``
    (a CPU-only build), with no other CUDA stack loaded: what ``import torch`` would tell
    NIXL's detection, learned without it."""
    if any(name in sys.modules for name in _CUDA_STACKS):
        return False
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False
        version = runpy.run_path(str(Path(spec.origin).parent / "version.py"))
    except Exception:  # unreadable: NIXL's detection decides, as before
        return False
    return "cuda" in version and version["cuda"] is None
