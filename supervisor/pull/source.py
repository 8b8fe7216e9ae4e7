"""Where a pull comes from and what the model is called: the errors a pull raises, a source
resolved to a URL and a file name, the checks on names and checksums, and models_dir.

A source is an http(s) URL, or a Hugging Face file, `owner/repo[@revision]:path/in/repo.gguf`,
which becomes `{HF_ENDPOINT}/{owner}/{repo}/resolve/{revision}/{path}` (HF_ENDPOINT defaults
to https://huggingface.co, as in huggingface_hub).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yarl import URL

if TYPE_CHECKING:
    from corral.supervisor.config import LoadedConfig

DEFAULT_HUB = "https://huggingface.co"
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
# owner/repo[@revision]:path — Hugging Face's repository id rules, roughly: no slash, colon or
# whitespace in either part; the revision may hold slashes (refs/pr/1).
_HUB_FORM = re.compile(r"^(?P<owner>[A-Za-z0-9][\w.-]*)/(?P<repo>[\w.-]+)"
                       r"(?:@(?P<rev>[^:\s]+))?:(?P<file>[^\s]+)$", re.ASCII)


class PullError(Exception):
    """A pull that failed; the message says why, for a person."""


class BadSource(PullError):
    """The source, name or checksum given cannot be pulled (a request error, not a failure)."""


class ModelExists(PullError):
    """The model file is there already and `force` was not given."""


class PullRunning(PullError):
    """Another pull writes the same file now."""


class TooManyPulls(PullError):
    """As many pulls run as the daemon allows at once."""


class NoSpace(PullError):
    """The models_dir's disk has no room for the rest of the file."""


class NoModelsDir(PullError):
    """Nowhere to put the file: the config has no models_dir."""


class ChecksumMismatch(PullError):
    pass


class NotGguf(PullError):
    pass

@dataclass(frozen=True)
class Source:
    url: str
    filename: str  # the model file's name in models_dir
    # Whether the URL is on the Hugging Face hub: only then does HF_TOKEN go with it, and only
    # then is an ETag read as the file's sha256.
    hub: bool = False

def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HUB).rstrip("/")


def safe_filename(name: str) -> str:
    """`name` if it is a plain model file name: it ends in .gguf, names no folder (no `/` or
    `\\`), does not start with `.` (hidden: a part file, `..`), holds no control character
    and fits a file system's limit. It is written inside models_dir, so a name from a hostile
    URL must not be able to point anywhere else."""
    if not name.endswith(".gguf") or name == ".gguf":
        raise BadSource(f"{name[:100]!r} is not a .gguf file name")
    if "/" in name or "\\" in name or name.startswith("."):
        raise BadSource(f"{name[:100]!r} is not a plain file name (no folders, no leading '.')")
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or len(name.encode()) > 240:
        raise BadSource(f"{name[:100]!r} is not a usable file name")
    return name


def resolve_source(spec: str, name: str | None = None) -> Source:
    """Where to download `spec` from, and the file name it gets in models_dir (`name`, with
    `.gguf` added when it lacks it, else the name the URL or repository path ends with)."""
    spec = spec.strip()
    hub = URL(hub_endpoint())
    if spec.startswith(("http://", "https://")):
        url = URL(spec)
        if not url.host:
            raise BadSource(f"{spec[:200]!r} has no host")
        # The path's last segment, percent-decoded: `%2e%2e%2fx.gguf` is `../x.gguf`, refused.
        tail = urllib.parse.unquote(url.raw_path.rsplit("/", 1)[-1])
        filename = tail
        on_hub = url.origin() == hub.origin()
    else:
        match = _HUB_FORM.match(spec)
        if match is None or "://" in spec:
            raise BadSource(f"{spec[:200]!r} is neither an http(s) URL nor a Hugging Face file "
                            "(owner/repo:file.gguf or owner/repo@revision:file.gguf)")
        parts = match["file"].split("/")
        if any(p in ("", ".", "..") for p in parts) or match["repo"] in (".", ".."):
            raise BadSource(f"{match['file'][:200]!r} is not a file path in a repository")
        revision = urllib.parse.quote(match["rev"] or "main", safe="")
        path = "/".join(urllib.parse.quote(p, safe="") for p in parts)
        url = URL(f"{hub}/{match['owner']}/{match['repo']}/resolve/{revision}/{path}",
                  encoded=True)
        filename = parts[-1]
        on_hub = True
    if name is not None:
        return Source(str(url), model_filename(name), hub=on_hub)
    try:
        return Source(str(url), safe_filename(filename), hub=on_hub)
    except BadSource as exc:
        raise BadSource(f"{exc}; the file name comes from the URL: give a name to save it "
                        "under") from None


def model_filename(name: str) -> str:
    """The file a model pulled under `name` is saved as: `name`, with `.gguf` added."""
    return safe_filename(name if name.endswith(".gguf") else name + ".gguf")


def check_sha256(value: str | None) -> str | None:
    if value is None:
        return None
    if not _SHA256.match(value.strip()):
        raise BadSource("sha256 must be 64 hexadecimal digits")
    return value.strip().lower()


def models_dir_of(loaded: LoadedConfig) -> Path | None:
    """The folder discovery reads for this config (None: no models_dir)."""
    return loaded.models_folder


def _hub_sha256(headers: Any) -> str | None:
    """The hub answers a resolve for an LFS file with `X-Linked-Etag: "<sha256>"` (and ETag the
    same on its own 200s); a 40-digit ETag is a git blob id, not a content hash."""
    for key in ("X-Linked-Etag", "ETag"):
        value = headers.get(key)
        if value:
            value = value.removeprefix("W/").strip('"')
            return value.lower() if _SHA256.match(value) else None
    return None
