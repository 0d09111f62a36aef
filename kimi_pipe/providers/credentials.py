"""Credential rules: the API key comes only from the environment and never reaches a
config, a header in the saved config, a log line or an error message."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kimi_pipe.core.plain import plain
from kimi_pipe.errors import ConfigError
from kimi_pipe.providers.errors import MissingApiKey

# An environment variable name: what `*api_key_env` must hold (not a key itself).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Words in a header name that mean it carries a credential (one list for the config and
# the command line).
CREDENTIAL_HEADER_WORDS = (
    "authorization",
    "api-key",
    "api_key",
    "apikey",
    "key",
    "token",
    "cookie",
    "secret",
)
# Environment variables that hold secrets (OPENROUTER_API_KEY, HF_TOKEN, ...).
_SECRET_VAR = re.compile(r"(?:API_?KEY|_TOKEN|_SECRET|ACCESS_KEY)$")
# What API keys look like (OpenRouter sk-or-v1-..., OpenAI sk-..., bearer tokens).
_KEY_SHAPE = re.compile(r"(?:\bsk[-][A-Za-z0-9_-]{16,}|\bBearer\s+\S{8,})")


def key_in_overrides(argv: list[str], environ: dict[str, str] | None = None) -> str | None:
    """Why an override would put a secret into the saved config (None: it would not)."""
    environ = dict(os.environ) if environ is None else environ
    secrets = [
        v
        for k, v in environ.items()
        if _SECRET_VAR.search(k.upper()) and len(v) >= 12 and not v.startswith("/")
    ]
    for arg in argv:
        if "=" not in arg:
            continue
        name, value = arg.split("=", 1)
        name = name.lstrip("+~")
        leaf = name.rsplit(".", 1)[-1].lower().replace("-", "_")
        if leaf.endswith(("api_key", "apikey")):
            return f"{name} must not be in the config"
        if (
            leaf.endswith("api_key_env")
            and value not in ("", "null")
            and not _ENV_NAME.fullmatch(value)
        ):
            return (
                f"{name} must name an environment variable (e.g. OPENROUTER_API_KEY), "
                "not hold the key"
            )
        if ".headers" in name.lower() and header_carries_credential(leaf):
            return f"{name} would carry a credential in a header"
        if _KEY_SHAPE.search(value) or any(secret in value for secret in secrets):
            return f"the value of {name} looks like an API key"
    return None


def refuse_keys_in_overrides(argv: Sequence[str]) -> None:
    """A ConfigError when an override would put a secret into what a run keeps of its command
    line (`.hydra/`, the log), whatever the key it is given under."""
    why = key_in_overrides(list(argv))
    if why:
        raise ConfigError(
            f"{why} (a run keeps its overrides in .hydra/ and its log); export the provider's "
            "key variable (e.g. OPENROUTER_API_KEY) instead"
        )


def header_carries_credential(name: str) -> bool:
    """Whether a header of this name would put a credential into the saved config."""
    lowered = name.lower()
    return any(word in lowered for word in CREDENTIAL_HEADER_WORDS)


def valid_env_name(value: str) -> bool:
    return _ENV_NAME.fullmatch(value) is not None


def api_key(key_env: str | None) -> str:
    """The key from the environment variable `key_env` (`provider.api_key_env`; None: the
    provider needs none, ""). A name, not the settings: settings validate with this module."""
    if key_env is None:
        return ""
    key = os.environ.get(key_env, "").strip()
    if not key:
        raise MissingApiKey(
            f"no API key: the environment variable {key_env} is not set.\n"
            f"  export {key_env}=sk-or-v1-...   (https://openrouter.ai/keys)\n"
            "The key is read only from the environment, never from the config."
        )
    return key


def scrub(text: str, key: str | None) -> str:
    if key and key in text:
        text = text.replace(key, "***")
    return text


# Words in an environment variable's name that make its value a secret (HF_TOKEN,
# OPENROUTER_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD); matched on whole `_` parts so
# KIMI_TOKENIZER_DIR (a path) is not one.
_SECRET_NAME_PARTS = ("KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS")
MIN_SECRET_LEN = 8  # shorter values ("1", "true") are no secret, and would match anything


class SecretInConfig(ConfigError, ValueError):
    """A config value holds the API key or another credential from the environment."""


def credential_values(environ: Mapping[str, str], key_env: str | None = None) -> dict[str, str]:
    """{value: variable name} of every environment value that looks like a credential."""
    out: dict[str, str] = {}
    for name, value in environ.items():
        parts = re.split(r"[^A-Z0-9]+", name.upper())
        looks_secret = name == key_env or any(
            part in _SECRET_NAME_PARTS or part.endswith(("KEY", "TOKEN")) for part in parts
        )
        value = value.strip()
        if looks_secret and len(value) >= MIN_SECRET_LEN and not value.startswith("/"):
            out[value] = name
    return out


def _leaves(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _leaves(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{where}[{i}]")
    else:
        yield where, node


def refuse_secrets(
    cfg: Any, environ: Mapping[str, str] | None = None, extra: Mapping[str, Any] | None = None
) -> None:
    """Refuse a config in which any resolved value (its keys included) holds the API key or
    the value of an environment variable that looks like a credential: it would reach
    `.hydra/`, the log, the records or a file name. The message names the config key and
    the variable, never the value. `extra`: more resolved values by name (hydra.run.dir)."""

    environ = os.environ if environ is None else environ
    key_env = None
    if isinstance(cfg, Mapping):
        key_env = (cfg.get("provider") or {}).get("api_key_env")
    secrets = credential_values(environ, str(key_env) if key_env else None)
    if not secrets:
        return
    data = plain(cfg)
    pairs = list(_leaves(data, "")) + list((extra or {}).items())
    for where, value in pairs:
        for text in (str(value) if value is not None else "", where):
            for secret, name in secrets.items():
                if secret in text:
                    raise SecretInConfig(
                        f"{where} holds the value of ${name} (a credential); it would be "
                        "written to .hydra/, logs, records or file names. Remove it: the API "
                        "key is read only from the environment variable provider.api_key_env "
                        "names"
                    )
