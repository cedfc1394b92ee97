"""Hugging Face models by name, from the local cache only (never a download), and the name a
model is served under.

``snapshot_dir("Qwen/Qwen3-0.6B", revision)`` finds the repo's snapshot directory in the hub
cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; read at call
time) through ``huggingface_hub`` with ``local_files_only=True``. A repo that is not there is a
:class:`CheckpointError` that says where it looked.
"""

from __future__ import annotations

import os
from pathlib import Path
import re
from typing import Optional

from engine.errors import CheckpointError

# org/name, as the Hub spells repo ids (no leading dot or slash, one slash)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w][\w.-]{0,95}$")
#: The name the embedded default model is served under.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def looks_like_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and ".." not in spec and not spec.endswith(".gguf")


def hub_cache_dir() -> Path:
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def snapshot_dir(repo_id: str, revision: Optional[str] = None) -> Path:
    """The local snapshot of ``repo_id`` at ``revision`` (a branch, tag or commit; default
    ``main``). Raises :class:`CheckpointError` naming the cache directory when it is not there."""
    cache = hub_cache_dir()
    where = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise CheckpointError(repo_id, "huggingface_hub is not installed") from exc
    try:
        path = snapshot_download(repo_id, revision=rev, cache_dir=str(cache),
                                 local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as exc:
        raise CheckpointError(
            repo_id, f"not a local directory, and revision {rev!r} is not in the Hugging Face "
                     f"cache (looked in {where}; set HF_HUB_CACHE or HF_HOME, or download it "
                     f"first, e.g. `hf download {repo_id}`)") from exc
    return Path(path)


def resolve_model_path(spec: str, revision: Optional[str] = None) -> Path:
    """A checkpoint directory or file for ``spec``: an existing path as it is, else a repo id
    from the cache. A path that does not exist and is no repo id stays as it is (the loader
    reports it)."""
    path = Path(spec).expanduser()
    if path.exists() or not looks_like_repo_id(spec):
        return path
    return snapshot_dir(spec, revision)


def display_name(spec: str) -> str:
    """The name a model is served under by default: the repo id, a checkpoint's own name (its
    directory, a GGUF's stem without the quantization), ``SmolLM2-135M-Instruct`` for the
    embedded default, ``random:<preset>`` as it is."""
    if spec == "default":
        return DEFAULT_MODEL_NAME
    if spec.startswith("random:"):
        return spec
    path = Path(spec).expanduser()
    if not path.exists():
        return spec  # a repo id (or a path that will fail to load)
    path = path.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    if path.suffix == ".gguf":
        return path.name.split(".", 1)[0]
    return path.name


__all__ = ["snapshot_dir", "resolve_model_path", "display_name", "looks_like_repo_id",
           "hub_cache_dir", "DEFAULT_MODEL_NAME"]
