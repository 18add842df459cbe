"""The proxy's refusals of a body vLLM refuses before its handler runs, in vLLM's own words.

vLLM (0.32) reads a body through FastAPI, whose ``RequestValidationError`` vLLM's handler
(``vllm/entrypoints/serve/exception_handling/handlers/validation.py``) answers as
``{"error": {"message", "type": "Bad Request", "param", "code": 400}}``:

* bytes that are not JSON: one ``json_invalid`` error at ``("body", pos)``, ``pos`` the
  character where Python's parser stopped: ``param`` ``"body.28"``;
* JSON that is not an object (an array, a string, a number, ``true``): ``model_attributes_type``
  at ``("body",)``; ``null`` or no body at all: ``missing`` there;
* the message: ``"1 validation error:\\n  "`` and the error as Python prints a dict, its ``input``
  summarized (``'<list of 2 items>'``, a scalar's ``str()``), its ``loc`` joined with dots.

The proxy answers these cases with the very same object, so a client cannot tell the proxy's
refusal from vLLM's (the proxy's log line and counter still say who refused). The golden
answers, taken from a real vLLM server, are in tests/proxy/test_vllm_error_shape.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["BAD_REQUEST", "json_invalid", "not_an_object", "validation_error"]

BAD_REQUEST = "Bad Request"
"""vLLM's ``type`` for a validation error (``HTTPStatus.BAD_REQUEST.phrase``)."""

_MAX_INPUT_CHARS = 200  # vLLM's _MAX_ERROR_INPUT_CHARS
_MAX_ERROR_CHARS = 1000  # vLLM's _MAX_ERROR_CHARS


def validation_error(error: dict[str, Any]) -> dict[str, Any]:
    """The answer vLLM gives to one validation ``error`` (``loc`` already joined, ``input``
    as parsed): its ``param`` is the ``loc``."""
    error = dict(error)
    if "input" in error:
        error["input"] = _summarize(error["input"])
    text = str(error)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return {"error": {"message": _sanitize(f"1 validation error:\n  {text}"),
                      "type": BAD_REQUEST, "param": error["loc"], "code": 400}}


def json_invalid(exc: json.JSONDecodeError) -> dict[str, Any]:
    """vLLM's answer to a body Python's JSON parser stopped in (FastAPI's ``json_invalid``)."""
    return validation_error({"type": "json_invalid", "loc": f"body.{exc.pos}",
                             "msg": "JSON decode error", "input": {},
                             "ctx": {"error": exc.msg}})


def not_an_object(value: Any) -> dict[str, Any]:
    """vLLM's answer to a JSON body that is not an object (``None``: ``null`` or no body)."""
    if value is None:
        return validation_error({"type": "missing", "loc": "body", "msg": "Field required",
                                 "input": None})
    return validation_error({"type": "model_attributes_type", "loc": "body",
                             "msg": "Input should be a valid dictionary or object to extract "
                                    "fields from", "input": value})


def _summarize(value: Any) -> Any:
    """vLLM's stand-in for an error's ``input``: containers by their size, the rest by str()."""
    if isinstance(value, str):
        return value[:_MAX_INPUT_CHARS] + "...[truncated]" if len(
            value) > _MAX_INPUT_CHARS else value
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def _sanitize(message: str) -> str:
    """vLLM's sanitize_message: memory addresses, tracebacks and file paths taken out."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>",
                     message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()
