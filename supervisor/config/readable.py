"""Config files that hold a secret in clear and that every local user may read: corral never
shows a secret (it is typed as one), but a file with `api_keys: [sk-...]` left at the umask's
0644 shows them to anyone on the machine. Said as a warning (at serve, by `corral check`), not
refused: the operator may know the machine has no other users."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from corral.supervisor.config.loaded import LoadedConfig
from corral.supervisor.config.secrets import SecretOptions
from corral.supervisor.config.yaml import ENV_REF

__all__ = ["READABLE_HINT", "secrets_readable_by_others"]

_ENV_REF = re.compile(ENV_REF.pattern.encode())  # on the file's bytes
# Shorter values (a model's `env: {CUDA_VISIBLE_DEVICES: "0"}`, typed secret like every env
# value) would be found in any file.
_SHORTEST = 8

READABLE_HINT = ("every local user can read the secrets written in it in clear: `chmod o-r` "
                 "it (root:corral 0640 for the service), or write them as ${VAR} and give "
                 "corral the variable")


def _secret_values(value: Any) -> Iterator[str]:
    if isinstance(value, SecretStr):
        yield value.get_secret_value()
    elif isinstance(value, SecretOptions):
        yield from (v for v in value.get_secret_value().values() if isinstance(v, str))
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _secret_values(getattr(value, name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _secret_values(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _secret_values(item)


def secrets_readable_by_others(loaded: LoadedConfig) -> list[tuple[Path, int]]:
    """(file, its mode) of each config file that others may read and that holds, as written,
    one of the config's secrets (one from ${VAR} is in the environment, not the file)."""
    secrets = {s.encode() for s in _secret_values(loaded.config) if len(s) >= _SHORTEST}
    if not secrets:
        return []
    found = []
    for path in loaded.files:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if not mode & stat.S_IROTH:
                continue
            text = path.read_bytes()
        except OSError:
            continue
        # A `${VAR:-placeholder}`'s placeholder is written in clear, but the file asks for
        # the variable: a shipped example's `change-me` is not a secret pasted in.
        text = _ENV_REF.sub(b"", text)
        if any(secret in text for secret in secrets):
            found.append((path, mode))
    return found
