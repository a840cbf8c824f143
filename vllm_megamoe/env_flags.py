"""On/off environment variables, read the same way everywhere: the plugin's settings accept
1/0, true/false, yes/no and on/off for a flag, so the core reading a variable itself must too
(`VLLM_MEGAMOE_JIT_LINEINFO=true` used to be read as off)."""
from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_flag(raw: object) -> bool:
    """True / False for a flag's spelling; ValueError for anything else."""
    s = str(raw).strip().lower()
    if s in TRUE:
        return True
    if s in FALSE:
        return False
    raise ValueError("must be a boolean (1/0, true/false, yes/no, on/off)")


def parse_auto_flag(raw: object) -> bool | None:
    """None for 'auto', else parse_flag's True / False; ValueError for anything else."""
    if str(raw).strip().lower() == "auto":
        return None
    try:
        return parse_flag(raw)
    except ValueError:
        raise ValueError("must be auto or a boolean (1/0, true/false, yes/no, on/off)") from None


def env_flag(name: str, default: bool) -> bool:
    """The flag `name` from the environment (unset or empty: `default`); a bad value is an error
    that names the variable."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return parse_flag(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} {e}") from None
