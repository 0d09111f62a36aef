"""`ResolveSettings`: how the target judges a record's candidates (the `resolve` group), and
which slack its numerics are allowed (slack.py). Plain data, no torch: the extract stage
builds it at its door (kimi_pipe/stages/jobs/extract.py) before any model is loaded, so a
mistake in the settings or a missing input is said without loading one. The judge itself is
resolve.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.slack import (
    GREEDY_SLACK,
    LOW_PRECISION_GREEDY_SLACK,
    LOW_PRECISION_NUCLEUS_SLACK,
    NUCLEUS_SLACK,
)

if TYPE_CHECKING:
    from kimi_pipe.extraction.sampler import Sampling


@dataclass(frozen=True)
class ResolveSettings:
    enabled: bool = True
    min_posterior: float = 0.999
    default_temperature: float | None = None  # for records whose request sent none
    max_options: int = 64  # a larger set is left unresolved (scoring cost)
    lock_timeout_s: float = 300.0
    split_check: bool = True  # the target confirms text-proven ids are the sampled split
    # Explain a bill that no reading fits by a non-canonical split (off: flagged, see yaml).
    billing_splits: bool = False
    # How far past the sampler's edge a token still counts as drawable (the provider's numerics
    # are not the judge's); None: by the judge's compute dtype (`judge_dtype`, set by extract).
    nucleus_slack: float | None = None
    greedy_slack: float | None = None
    # Opt-in: a record the target leaves unresolved gets one option DRAWN from its posterior
    # (evidence posterior_sampled, never exact; core/posterior.py), seeded by this and its id.
    posterior_sampled: bool = False
    posterior_seed: int = 0
    # Branch forwards the split check (and the prefix check) may spend on a record's other
    # readings together; past it the search is incomplete and the record is not trusted.
    near_reading_branches: int = 256
    judge_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not 0.5 < self.min_posterior <= 1.0:
            raise ConfigError(
                f"resolve.min_posterior must be in (0.5, 1], got {self.min_posterior}"
            )
        if isinstance(self.near_reading_branches, bool) or not (
            isinstance(self.near_reading_branches, int) and self.near_reading_branches >= 1
        ):
            raise ConfigError(
                "resolve.near_reading_branches must be a whole number >= 1, got "
                f"{self.near_reading_branches!r}"
            )
        for name in ("nucleus_slack", "greedy_slack"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ConfigError(f"resolve.{name} must be in [0, 1) or null, got {value}")

    @property
    def slacks(self) -> tuple[float, float]:
        """(nucleus, greedy) slack: as configured, else by the judge's compute dtype."""
        full = self.judge_dtype in ("float32", "float64")
        nucleus = NUCLEUS_SLACK if full else LOW_PRECISION_NUCLEUS_SLACK
        greedy = GREEDY_SLACK if full else LOW_PRECISION_GREEDY_SLACK
        return (
            nucleus if self.nucleus_slack is None else self.nucleus_slack,
            greedy if self.greedy_slack is None else self.greedy_slack,
        )

    def sampling_of(self, record: Mapping[str, Any]) -> Sampling | None:
        """The sampling a record's request sent, as this judge reads it (None: unknown)."""
        from kimi_pipe.extraction.sampler import Sampling  # torch: only where a judge runs

        return Sampling.from_record(record.get("sampling"), self.default_temperature, *self.slacks)

    @classmethod
    def from_values(
        cls, data: Mapping[str, Any] | None, judge_dtype: Any = None
    ) -> ResolveSettings:
        """The `resolve` group's plain values; `judge_dtype`: `extract.dtype` (None: float32)."""
        data = dict(data or {})
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        unknown = set(data) - set(known)
        if unknown or "judge_dtype" in known:
            extra = sorted(unknown | ({"judge_dtype"} & set(known)))
            raise ConfigError(f"unknown resolve keys {extra} (conf/resolve/default.yaml)")
        # The judge is the extraction model: its compute dtype sets the default slacks.
        return cls(**known, judge_dtype=str(judge_dtype or "float32"))
