"""Pulling a GGUF into models_dir: `corral pull` and POST /admin/pull.

One job a module, each importing only those before it:
- source: the errors, a source resolved to a URL and a file name (an http(s) URL or a Hugging
  Face `owner/repo[@revision]:file.gguf`), the checks on names and checksums, models_dir;
- part: the hidden `.<name>.gguf.part` being written (its validators file, its lock) and
  placing the finished file;
- download: `pull()`, the HTTP download with its resumes, retries and checks;
- jobs: the daemon's pulls (`Puller`, `PullJob`) and their `pull` events.

The names callers use are re-exported here.
"""

from corral.supervisor.pull.download import ProgressFn, Pulled, pull
from corral.supervisor.pull.jobs import PULL_STATES, Puller, PullJob
from corral.supervisor.pull.part import part_paths
from corral.supervisor.pull.source import (
    BadSource,
    ChecksumMismatch,
    ModelExists,
    NoModelsDir,
    NoSpace,
    NotGguf,
    PullError,
    PullRunning,
    Source,
    TooManyPulls,
    check_sha256,
    hub_endpoint,
    model_filename,
    models_dir_of,
    resolve_source,
    safe_filename,
)

__all__ = [
    "PULL_STATES",
    "BadSource",
    "ChecksumMismatch",
    "ModelExists",
    "NoModelsDir",
    "NoSpace",
    "NotGguf",
    "ProgressFn",
    "PullError",
    "PullJob",
    "PullRunning",
    "Pulled",
    "Puller",
    "Source",
    "TooManyPulls",
    "check_sha256",
    "hub_endpoint",
    "model_filename",
    "models_dir_of",
    "part_paths",
    "pull",
    "resolve_source",
    "safe_filename",
]
