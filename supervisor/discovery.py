"""What a models directory holds: one model per *.gguf, except that split files and projectors
are not models of their own. Names only: no file is opened.

Rules (documented in README, "Config"):
- A split model (`name-00001-of-00003.gguf`, ...) is one model, `name`, whose path is the first
  shard (llama-server finds the rest beside it). The other shards are never listed; a split
  model without its first shard is not listed at all.
- A file whose name contains `mmproj` is a multimodal projector, never a model. Its key is its
  name without `mmproj` and without a trailing quantisation tag (Q4_K_M, IQ4_XS, F16, BF16,
  F32, ...); a model's key is its name without that tag. Keys compare case-insensitively.
  A projector belongs to every model with its key (every quantisation of one model shares one
  projector); a projector whose key is empty (`mmproj-F16.gguf`) belongs to the models of the
  directory only when they all share one key. A model that more than one projector would
  belong to gets none: say which in the config with `mmproj:`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_MMPROJ = re.compile(r"[-_.]*mmproj[-_.]*", re.IGNORECASE)
# Quantisation / precision suffixes as llama.cpp and the usual uploaders name them.
_QUANT_TAG = re.compile(r"(?:^|[-_.])(?:i?q\d[a-z0-9_]*|bf16|fp16|fp32|f16|f32)$", re.IGNORECASE)


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


def discover(models_dir: Path) -> list[Discovered]:
    """The models in `models_dir`, sorted by file name, each with its projector if any."""
    if not models_dir.is_dir():
        return []
    models: dict[str, Discovered] = {}
    projectors: list[Path] = []
    for path in sorted(p.resolve() for p in models_dir.glob("*.gguf") if p.is_file()):
        if is_projector(path.name):
            projectors.append(path)
            continue
        shard = SHARD.search(path.name)
        if shard:
            if int(shard.group(1)) != 1:
                continue  # a later shard: its model is listed under the first one
            name = path.name[:shard.start()]
        else:
            name = path.stem
        # Names collide only in odd folders (`foo.gguf` beside `foo-00001-of-00002.gguf`):
        # the first in file-name order keeps the name.
        models.setdefault(name, Discovered(name, path))
    return [_with_projector(m, projectors, models) for m in models.values()]


def _with_projector(model: Discovered, projectors: list[Path],
                    models: dict[str, Discovered]) -> Discovered:
    keys = {model_key(name) for name in models}
    mine = model_key(model.name)
    matches = [p for p in projectors
               if projector_key(p.stem) == mine or (not projector_key(p.stem) and len(keys) == 1)]
    if len(matches) != 1:
        return model  # none, or ambiguous: guessing wrong would feed the model another's vision
    return Discovered(model.name, model.path, matches[0])
