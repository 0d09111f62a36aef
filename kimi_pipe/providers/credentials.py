"""Credential rules: the API key comes only from the environment and never reaches a
config, a header in the saved config, a log line or an error message."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from kimi_pipe.providers.errors import MissingApiKey

if TYPE_CHECKING:
    from kimi_pipe.providers.settings import ProviderSettings

# An environment variable name: what `*api_key_env` must hold (not a key itself).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Words in a header name that mean it carries a credential (one list for the config and
# the command line).
CREDENTIAL_HEADER_WORDS = ("authorization", "api-key", "api_key", "apikey", "key", "token",
                           "cookie", "secret")
# Environment variables that hold secrets (OPENROUTER_API_KEY, HF_TOKEN, ...).
_SECRET_VAR = re.compile(r"(?:API_?KEY|_TOKEN|_SECRET|ACCESS_KEY)$")
# What API keys look like (OpenRouter sk-or-v1-..., OpenAI sk-..., bearer tokens).
_KEY_SHAPE = re.compile(r"(?:\bsk[-][A-Za-z0-9_-]{16,}|\bBearer\s+\S{8,})")


def key_in_overrides(argv: list[str], environ: dict[str, str] | None = None) -> str | None:
    """Why an override would put a secret into the saved config (None: it would not)."""
    environ = dict(os.environ) if environ is None else environ
    secrets = [v for k, v in environ.items()
               if _SECRET_VAR.search(k.upper()) and len(v) >= 12 and not v.startswith("/")]
    for arg in argv:
        if "=" not in arg:
            continue
        name, value = arg.split("=", 1)
        name = name.lstrip("+~")
        leaf = name.rsplit(".", 1)[-1].lower().replace("-", "_")
        if leaf.endswith(("api_key", "apikey")):
            return f"{name} must not be in the config"
        if leaf.endswith("api_key_env") and value not in ("", "null") and not _ENV_NAME.fullmatch(
                value):
            return (f"{name} must name an environment variable (e.g. OPENROUTER_API_KEY), "
                    "not hold the key")
        if ".headers" in name.lower() and header_carries_credential(leaf):
            return f"{name} would carry a credential in a header"
        if _KEY_SHAPE.search(value) or any(secret in value for secret in secrets):
            return f"the value of {name} looks like an API key"
    return None


def header_carries_credential(name: str) -> bool:
    """Whether a header of this name would put a credential into the saved config."""
    lowered = name.lower()
    return any(word in lowered for word in CREDENTIAL_HEADER_WORDS)


def valid_env_name(value: str) -> bool:
    return _ENV_NAME.fullmatch(value) is not None


def api_key(settings: ProviderSettings) -> str:
    """The key from the environment ("" when the provider needs none)."""
    if settings.api_key_env is None:
        return ""
    key = os.environ.get(settings.api_key_env, "").strip()
    if not key:
        raise MissingApiKey(
            f"no API key: the environment variable {settings.api_key_env} is not set.\n"
            f"  export {settings.api_key_env}=sk-or-v1-...   (https://openrouter.ai/keys)\n"
            "The key is read only from the environment, never from the config.")
    return key


def scrub(text: str, key: str | None) -> str:
    if key and key in text:
        text = text.replace(key, "***")
    return text
