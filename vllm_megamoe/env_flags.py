"""The spellings of an on/off value, the same everywhere: vllm_megamoe/settings.py (the one reader
of the VLLM_MEGAMOE_* variables) and the probes' options accept 1/0, true/false, yes/no and on/off
(`VLLM_MEGAMOE_JIT_LINEINFO=true` used to be read as off)."""
from __future__ import annotations

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
