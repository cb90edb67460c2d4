"""A command-line option holding an inline YAML mapping (engine arguments merged into an arm)."""
from __future__ import annotations

from typing import Any, Optional

import yaml


def yaml_mapping(text: Optional[str], flag: str) -> dict[str, Any]:
    """`text` parsed as a YAML mapping ({} when empty or null); ValueError naming `flag` otherwise."""
    try:
        data = yaml.safe_load(text) if text else None
    except yaml.YAMLError as e:
        raise ValueError(f"{flag} {text!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {text!r} is not a YAML mapping")
    return data
