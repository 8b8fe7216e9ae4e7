"""What every section of the schema shares."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, SecretStr

__all__ = ["STRICT", "HeaderKey", "SentKey"]

# Every section's model_config (set on each class, so linters see a pydantic model there).
# Unknown keys are errors: a typo like `tll: 60` must not pass silently. A validation error
# never quotes the value it refused: the value may be a token.
STRICT = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


def _sendable(value: SecretStr) -> SecretStr:
    """A key or token is sent in a header (Authorization: Bearer, x-api-key): one a client
    cannot send, or one that is empty (which a bare `Authorization: Bearer` would match), is
    refused where it is written. The message never quotes it."""
    key = value.get_secret_value()
    if not key:
        raise ValueError("a key may not be empty (a bare `Authorization: Bearer` would match "
                         "it); an unset ${VAR:-} gives one")
    if not all("\x21" <= c <= "\x7e" for c in key):
        raise ValueError("a key holds a space, a control character or a character outside "
                         "ASCII: HTTP clients (browsers, the OpenAI SDKs) cannot send it in a "
                         "header")
    return value


# A key or token that travels in a request header (the pattern is for editors that read
# presets/corral.schema.json; the check is _sendable's).
HeaderKey = Annotated[SecretStr, AfterValidator(_sendable),
                      Field(json_schema_extra={"pattern": "^[!-~]+$"})]


def _none_when_empty(value: object) -> object:
    return None if value == "" else value


# A key corral sends (a remote's api_key): empty is none at all (`${OPENAI_API_KEY:-}` for an
# endpoint that may need none), else as a HeaderKey.
SentKey = Annotated[
    Annotated[SecretStr, AfterValidator(_sendable),
              Field(json_schema_extra={"pattern": "^[!-~]*$"})] | None,
    BeforeValidator(_none_when_empty)]
