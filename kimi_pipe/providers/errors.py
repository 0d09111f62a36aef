"""What a provider call can go wrong with: the user-facing exceptions (in the package's one
error tree, `kimi_pipe/errors.py`) and the classified failure of one attempt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kimi_pipe.errors import BudgetError, ConfigError, ProviderError


class MissingApiKey(ConfigError, RuntimeError):
    pass


class ProviderConfigError(ConfigError, ValueError):
    pass


class ProviderUnreachable(ProviderConfigError):
    """The provider's host could not be reached at all (no network, a wrong api_base): its
    price listing is not merely missing."""


class PriceError(ProviderConfigError, BudgetError):
    """Prices that exist but cannot be trusted: never replaced by fallback prices."""


class ResponseTooLarge(ProviderError):
    pass


@dataclass(frozen=True)
class ErrorInfo:
    cls: str  # short stable class: rate_limited, timeout, server_error, payment_required, ...
    status: int | None
    message: str
    action: str  # "retry" | "fail" (this sample) | "stop" (the run)
    retry_after_s: float | None = None

    def to_record(self) -> dict[str, Any]:
        return {"class": self.cls, "message": self.message, "status": self.status}


STOPPED = ErrorInfo("stopped", None, "the run is stopping", "stop")
NO_BUDGET = ErrorInfo("budget", None, "budget cap reached", "stop")
