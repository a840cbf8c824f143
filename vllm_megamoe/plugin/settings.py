"""Moved: the settings registry and reader are vllm_megamoe/settings.py (no vLLM import). This
module only re-exports them for code that still imports them from here."""
from ..settings import (CONFIG_ENV, ENV_PREFIX, KEYS, Key, Settings, env_help,  # noqa: F401
                        load_settings, setting, unknown_environment_names)
