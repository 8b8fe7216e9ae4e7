"""What a models directory holds: one model per *.gguf, except that split files and projectors
are not models of their own. Names only: no file is opened.

Rules (documented in README, "Config", "Discovery"):
- The folder is scanned with its subfolders, down to MAX_DEPTH levels below it. Hidden files
  and folders (a name starting with ".") are skipped: downloads in progress live there
  (`corral pull` writes `.<name>.gguf.part` and renames it when complete), and so do caches
  and version control. Only names ending in `.gguf` count, so `x.gguf.part` is never a model.
  Symlinks are followed, to files and to folders; a folder reached twice (a link loop, or
  two links to one folder) is scanned once.
- A model is named after its file without `.gguf`, wherever it lies. When files in different
  folders would give one name, each of them that lies in a subfolder is named with its folder
  relative to models_dir instead (`org/model-Q4_K_M`); one in models_dir itself keeps the
  plain name. So a name can change when a file of the same name appears elsewhere: a model
  that must keep its name is configured under `models:`.
- A split model (`name-00001-of-00003.gguf`, ...) is one model, `name`, whose path is the first
  shard (llama-server finds the rest beside it). The other shards are never listed; a split
  model missing any of its shards (the first, or one still being pulled or copied) is not
  listed at all.
- A file whose name contains `mmproj` is a multimodal projector, never a model. It pairs only
  with models in its own folder (the usual download: one folder per repository, holding the
  quantisations and the projector). Its key is its name without `mmproj` and without a
  trailing quantisation tag (Q4_K_M, IQ4_XS, F16, BF16, F32, ...); a model's key is its name
  without that tag. Keys compare case-insensitively. A projector belongs to every model of its
  folder with its key (every quantisation of one model shares one projector); a projector
  whose key is empty (`mmproj-F16.gguf`) belongs to the models of its folder only when they
  all share one key. A model that more than one projector would belong to gets none: say
  which in the config with `mmproj:`.
- A file the models_dir watcher has seen change within the last seconds is held back (see
  `hold_back`): a copy still being written is not listed half-written.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_MMPROJ = re.compile(r"[-_.]*mmproj[-_.]*", re.IGNORECASE)
# Quantisation / precision suffixes as llama.cpp and the usual uploaders name them.
_QUANT_TAG = re.compile(r"(?:^|[-_.])(?:i?q\d[a-z0-9_]*|bf16|fp16|fp32|f16|f32)$", re.IGNORECASE)
# Folders below models_dir that are scanned: deep enough for org/repo/revision layouts, shallow
# enough that a models_dir pointed at a home folder by mistake does not walk it all.
MAX_DEPTH = 8

# Files being written right now, as the models_dir watcher saw them (absolute paths as it
# watches them). discover() runs in reload threads, the watcher on the event loop: a lock.
_held: set[str] = set()
_held_lock = threading.Lock()


@dataclass(frozen=True)
class Discovered:
    name: str
    path: Path
    mmproj: Path | None = None


def is_projector(filename: str) -> bool:
    return "mmproj" in filename.lower()


def model_key(name: str) -> str:
    return _QUANT_TAG.sub("", name).strip("-_.").lower()


def projector_key(stem: str) -> str:
    # `foo-mmproj-f16` → `foo-f16` → `foo`; `mmproj-foo` → `foo`; `mmproj-F16` → ``.
    return model_key(_MMPROJ.sub("-", stem).strip("-_."))


def hold_back(paths: Iterable[str], held: bool) -> None:
    """Leave `paths` out of every discover() until released (held False): files still growing.
    Several watchers may hold files at once; each releases its own."""
    with _held_lock:
        (_held.update if held else _held.difference_update)(paths)


def held_back() -> frozenset[str]:
    with _held_lock:
        return frozenset(_held)


# (name, model file, projector file) of each discovered model, then (path, size, mtime_ns) of
# every file of theirs: what a reload would see differently.
Signature = tuple[tuple[tuple[str, str, str], ...], tuple[tuple[str, int, int], ...]]


def signature(folder: Path, found: list[Discovered] | None = None) -> Signature:
    """What discovery lists in `folder` now (or listed: `found`), and the size and mtime of
    each listed file."""
    from corral.supervisor.inventory import shards

    if found is None:
        found = discover(folder)
    listed = tuple((m.name, str(m.path), str(m.mmproj or "")) for m in found)
    stats: list[tuple[str, int, int]] = []
    for model in found:
        for path in [*shards(model.path), *([model.mmproj] if model.mmproj else [])]:
            try:
                st = path.stat()
            except OSError:
                continue
            stats.append((str(path), st.st_size, st.st_mtime_ns))
    return listed, tuple(stats)


def discover(models_dir: Path) -> list[Discovered]:
    """The models under `models_dir`, folder by folder (models_dir first, then its subfolders
    depth first, each in name order), each with its projector if any."""
    if not models_dir.is_dir():
        return []
    root = models_dir.resolve()
    held = held_back()
    found: list[tuple[str, Discovered]] = []  # (folder relative to root, model)
    for folder, files in _folders(root):
        rel = "" if folder == root else folder.relative_to(root).as_posix()
        found += [(rel, model) for model in _in_folder(folder, _settled(folder, files, held))]
    clashes = Counter(model.name for _, model in found)
    return [dataclasses.replace(model, name=f"{rel}/{model.name}")
            if rel and clashes[model.name] > 1 else model for rel, model in found]


def _settled(folder: Path, files: list[str], held: frozenset[str]) -> list[str]:
    """`files` less those held back; a split model goes whole while any shard is held."""
    if not held:
        return files
    out = [f for f in files if str(folder / f) not in held]
    splits = {f[:m.start()] + m.group(2) for f in files if f not in out
              for m in [SHARD.search(f)] if m}
    return [f for f in out if not ((m := SHARD.search(f)) and f[:m.start()] + m.group(2) in splits)]


def _folders(root: Path) -> Iterator[tuple[Path, list[str]]]:
    """(folder, its *.gguf file names, sorted) for root and every folder below it."""
    seen: set[str] = set()
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:
            continue  # a link loop, or a folder linked twice: scanned once
        seen.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue  # unreadable, or removed while we walk: nothing to list there
        files: list[str] = []
        subfolders: list[Path] = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir():  # follows a link
                    subfolders.append(folder / entry.name)
                elif entry.name.endswith(".gguf") and entry.is_file():
                    files.append(entry.name)
            except OSError:
                continue  # a dangling link
        yield folder, files
        if depth < MAX_DEPTH:
            stack.extend((sub, depth + 1) for sub in reversed(subfolders))


def _in_folder(folder: Path, files: list[str]) -> list[Discovered]:
    """One folder's models, by the split and projector rules, with their plain names."""
    models: dict[str, Discovered] = {}
    projectors: list[Path] = []
    for filename in files:
        # Not resolved: a symlinked file keeps its own name (a Hugging Face cache links
        # `model-00001-of-00002.gguf` to a blob named by its hash), and llama-server finds the
        # other shards beside the name it was given.
        path = folder / filename
        if is_projector(filename):
            projectors.append(path)
            continue
        shard = SHARD.search(filename)
        if shard:
            if int(shard.group(1)) != 1:
                continue  # a later shard: its model is listed under the first one
            name = filename[:shard.start()]
            if not _all_shards(files, name, shard.group(2)):
                continue  # half a model (shards still being pulled or copied) is no model
        else:
            name = filename.removesuffix(".gguf")
        # Names collide only in odd folders (`foo.gguf` beside `foo-00001-of-00002.gguf`):
        # the first in file-name order keeps the name.
        models.setdefault(name, Discovered(name, path))
    return [_with_projector(m, projectors, models) for m in models.values()]


def _all_shards(files: list[str], name: str, count: str) -> bool:
    present = set(files)
    return all(f"{name}-{i:05d}-of-{count}.gguf" in present for i in range(1, int(count) + 1))


def _with_projector(model: Discovered, projectors: list[Path],
                    models: dict[str, Discovered]) -> Discovered:
    keys = {model_key(name) for name in models}
    mine = model_key(model.name)
    matches = [p for p in projectors
               if projector_key(p.stem) == mine or (not projector_key(p.stem) and len(keys) == 1)]
    if len(matches) != 1:
        return model  # none, or ambiguous: guessing wrong would feed the model another's vision
    return Discovered(model.name, model.path, matches[0])
