"""What every section of the schema shares."""

from __future__ import annotations

from pydantic import ConfigDict

__all__ = ["STRICT"]

# Every section's model_config (set on each class, so linters see a pydantic model there).
# Unknown keys are errors: a typo like `tll: 60` must not pass silently. A validation error
# never quotes the value it refused: the value may be a token.
STRICT = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)
