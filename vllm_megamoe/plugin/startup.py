"""What a user sees when vLLM starts with the plugin: its variables known to vLLM, its errors first.

1. vLLM warns "Unknown vLLM environment variable detected: VLLM_..." for every `VLLM_*` variable
   missing from `vllm.envs.environment_variables` (and with `--fail-on-environ-validation` refuses
   to start), which includes the plugin's `VLLM_MEGAMOE_*` settings. vLLM has no API through
   which a plugin declares variables; `declare_environment_variables` adds the plugin's names to
   that dict when the plugin registers (vLLM validates the environment after loading plugins), so
   the warning names only variables nobody knows: a misspelt `VLLM_MEGAMOE_*` one is still
   warned about by vLLM, and refused by the plugin with the key it is closest to.
2. The plugin's startup checks raise ValueError while vLLM builds its config (inside a pydantic
   dataclass, which wraps the error in a ValidationError): uncaught, Python then prints ~40 lines
   of traceback with the message near the end. `install_excepthook` makes the interpreter print
   such an error (one raised by vllm_megamoe code) as the message alone, `megamoe: error: ...`;
   every other exception is printed as before. VLLM_LOGGING_LEVEL=DEBUG keeps the traceback too.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Optional

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../vllm_megamoe
PREFIX = "megamoe: error: "


def declare_environment_variables(envs_module=None) -> int:
    """Add the plugin's variables to vLLM's table of known ones; returns how many were added (0
    where this vLLM keeps no such table: it then warns about them, which is harmless)."""
    from ..settings import CONFIG_ENV, KEYS
    if envs_module is None:
        try:
            import vllm.envs as envs_module
        except Exception:  # noqa: BLE001 - never let the plugin take vLLM down
            return 0
    table = getattr(envs_module, "environment_variables", None)
    if not isinstance(table, dict):
        return 0
    added = 0
    for name in [k.env for k in KEYS.values()] + [CONFIG_ENV]:
        if name not in table:
            table[name] = lambda name=name: os.environ.get(name)
            added += 1
    return added


def _raised_by_plugin(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep)


def plugin_error(exc: BaseException) -> Optional[BaseException]:
    """The plugin's own error behind `exc`: `exc` itself, the error a pydantic ValidationError
    wraps, or one in its cause / context chain, when it is a ValueError (bad input or setting) or a
    vllm_megamoe MegaMoEError raised by vllm_megamoe code; else None."""
    from ..errors import MegaMoEError
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e).__name__ == "ValidationError" and callable(getattr(e, "errors", None)):
            try:
                todo += [(err.get("ctx") or {}).get("error") for err in e.errors()]
            except Exception:  # noqa: BLE001 - not pydantic's after all
                pass
        elif isinstance(e, (ValueError, MegaMoEError)) and _raised_by_plugin(e):
            return e
        todo += [e.__cause__, e.__context__]
    return None


def one_line(message: str) -> str:
    """A startup message as the user should read it first: one problem on one line (the plugin's
    list of several problems keeps one line each)."""
    lines = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip()]
    if len(lines) == 2 and lines[1].startswith("- "):  # "cannot serve this configuration:\n  - fix"
        return f"{lines[0]} {lines[1][2:]}"
    return "\n  ".join(lines)


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        found = plugin_error(exc) if isinstance(exc, BaseException) else None
        if found is None:
            return previous(exc_type, exc, tb)
        if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG":
            previous(exc_type, exc, tb)
        sys.stderr.write(PREFIX + one_line(str(found)) + "\n")
        sys.stderr.flush()
    hook.__megamoe_previous__ = previous
    return hook


def install_excepthook() -> None:
    """Print the plugin's uncaught startup errors as their message alone (idempotent)."""
    if getattr(sys.excepthook, "__megamoe_previous__", None) is None:
        sys.excepthook = _excepthook(sys.excepthook)


def install() -> None:
    declare_environment_variables()
    install_excepthook()
