"""The single cattrs converter for wire <-> internal types.

Primitives are structured strictly (no "5" -> 5, no 1 -> True): a wrong type is a 400 naming
the field, not a silent coercion. Errors come out as ``InvalidRequest`` with a JSON path.
"""

from __future__ import annotations

from typing import Any, TypeVar

import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError

from mlxcel.runtime.errors import InvalidRequest, UnsupportedField

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True)


def _strict(kind: type, name: str, accept: tuple[type, ...]) -> None:
    def hook(value: Any, _: type) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {name}")
        if not isinstance(value, accept):
            raise TypeError(f"expected {name}")
        return kind(value)

    converter.register_structure_hook(kind, hook)


_strict(int, "an integer", (int,))
_strict(float, "a number", (int, float))
_strict(bool, "a boolean", (bool,))
_strict(str, "a string", (str,))


def structure(data: Any, cls: type[T]) -> T:
    """Build a wire object from parsed JSON, or raise InvalidRequest naming the field."""
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return converter.structure(data, cls)
    except ForbiddenExtraKeysError as error:
        raise UnsupportedField(sorted(error.extra_fields)[0]) from None
    except ClassValidationError as error:
        raise _to_invalid(error) from None
    except (TypeError, ValueError) as error:
        raise InvalidRequest(str(error)) from None


def _to_invalid(error: ClassValidationError) -> InvalidRequest:
    for exc in error.exceptions:
        if isinstance(exc, ForbiddenExtraKeysError):
            return UnsupportedField(sorted(exc.extra_fields)[0])
    messages = cattrs.transform_error(error, path="")
    first = messages[0] if messages else "invalid request"
    # transform_error writes "<what> @ .field"; put the field first for the reader.
    what, _, where = first.partition(" @ ")
    field = where.lstrip(".") or None
    text = f"Invalid value for '{field}': {what}" if field else what
    return InvalidRequest(text, param=field)
