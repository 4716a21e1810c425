"""What a string inside a sample stands for: a JSON value encoded one or more times, a local
image reference, or a remote one.

Both the sample contract (``schema``: tool-call arguments, image parts) and the tool-result
compaction (``tool_content``) ask these questions, so they live here, below both.

* **Repeated encoding.** An inference server that ``json.dumps``-es an already-encoded string
  turns ``{"a": 1}`` into ``"{\\"a\\": 1}"``; the field report's teacher then judged escaped
  garbage. ``decode_repeated`` peels up to ``MAX_ARG_DECODES`` string layers.
* **Remote images** (``https://...``, ``gs://...``, any ``scheme://`` but ``file://``) are shown
  as the text ``[image: URL]`` and never fetched: a sample's meaning must not depend on the network.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_ARG_DECODES = 4
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def decode_repeated(text: str, max_decodes: int = MAX_ARG_DECODES) -> tuple[Any, int]:
    """JSON-decode ``text`` while the result is still a string, at most ``max_decodes`` times ->
    (the last value decoded, how many decodes succeeded); (``text``, 0) when it is not JSON."""
    value: Any = text
    decodes = 0
    while isinstance(value, str) and decodes < max_decodes:
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, TypeError):
            break
        decodes += 1
    return value, decodes


def is_remote_image_ref(source: Any) -> bool:
    """A URL that is not a local file (http(s), gs, s3, ...): shown as text, never loaded."""
    return isinstance(source, str) and bool(_URL_SCHEME.match(source)) and not source.lower().startswith("file://")


def remote_image_text(source: str) -> str:
    return f"[image: {source}]"


def looks_like_image_ref(value: Any) -> bool:
    """Strings inside tool results that denote images (JSON fields become placeholders)."""
    if not isinstance(value, str):
        return False
    if value.startswith("data:image/"):
        return True
    return value.lower().endswith(IMAGE_EXTENSIONS) and "\n" not in value and len(value) < 1024
