"""Secrets in the config, typed: a value that is shown, logged or dumped as JSON reads
`**********`, and whoever needs the real one asks for it with `.get_secret_value()`.

Single values (tokens, API keys, a model's environment values) are pydantic's `SecretStr`.
`SecretOptions` does the same for a whole map handed to a plugin (a strategy's or a GPU
reader's `options`): corral cannot know which of its entries are secrets, so every value is one;
the keys stay visible, so an operator can still see which options are set. Redaction is thus a
property of the schema: /admin/config dumps the config as JSON and nothing more, and a new
secret field is hidden by being typed as one, not by being added to a list of names."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler, SecretStr
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

__all__ = ["MASK", "SecretOptions", "SecretStr"]

# What pydantic's SecretStr shows for any value; the maps show the same.
MASK = str(SecretStr("x"))


class SecretOptions:
    """A plugin's options: a string-keyed map whose values are all secret."""

    __slots__ = ("_options",)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._options: dict[str, Any] = dict(options or {})

    def get_secret_value(self) -> dict[str, Any]:
        """The options themselves: a deep copy, so a plugin that edits what it was given
        cannot change the (frozen) config the daemon holds."""
        return copy.deepcopy(self._options)

    def keys(self) -> list[str]:
        return list(self._options)

    def masked(self) -> dict[str, str]:
        """What is shown: every key, no value."""
        return dict.fromkeys(self._options, MASK)

    def __len__(self) -> int:
        return len(self._options)

    def __eq__(self, other: object) -> bool:
        # By value, as SecretStr compares: a reload diff must see an option change.
        return isinstance(other, SecretOptions) and self._options == other._options

    # Equal maps would have to hash alike, and the values (lists, maps) are not hashable.
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SecretOptions({self.masked()!r})"

    __str__ = __repr__

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        from_map = core_schema.no_info_after_validator_function(
            cls, core_schema.dict_schema(core_schema.str_schema(), core_schema.any_schema()))
        return core_schema.json_or_python_schema(
            json_schema=from_map,
            # An instance passes as it is: model_validate(model_dump()) keeps its options.
            python_schema=core_schema.union_schema(
                [core_schema.is_instance_schema(cls), from_map]),
            serialization=core_schema.plain_serializer_function_ser_schema(
                _serialize, info_arg=True))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        # A map of any values, marked as a secret the way SecretStr marks its strings.
        return {**handler(schema), "writeOnly": True}


def _serialize(value: SecretOptions, info: core_schema.SerializationInfo) -> Any:
    # JSON (what /admin/config and any dump to text get): masked. Python mode keeps the
    # object, as it does for SecretStr, so a dump-and-validate round trip loses nothing.
    return value.masked() if info.mode_is_json() else value
