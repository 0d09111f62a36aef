"""`serving=auto` (the default for generate): fit the serving profile from probes, then buy.

At the start of a generate job, before any answer is bought, the conformance battery
(`conf/probes/<model>.yaml`, conformance/probe.py) is bought once per provider the job will use,
pinned to it, and judged; each provider gets the conf/serving profile its answers fit. The
job is then pinned (`provider.routing.only`/`order`, no fallbacks) to the providers whose
quirks a profile undoes, and every record carries `serving_profile` (a conf/serving name, or
`NAME+FIELD=VALUE+...` where the measured fields differ from every listed profile) and
`serving_probe` (where the evidence is: `serving_auto.json#<provider>`).

Money: each provider's battery is booked in the job's own spend journal before it is bought
(an intent at its cap, settled with what the probe run's journal counted), so it counts in
`budget.usd` across kills and resumes like any answer. Verdicts are cached per (provider,
model, endpoint, battery) under `serving_auto.cache_dir` (default
`$XDG_CACHE_HOME/kimi_pipe/probes`, else `~/.cache/kimi_pipe/probes`) for
`serving_auto.cache_days`; a cache hit spends nothing.

Which providers: `serving_auto.providers`, else `provider.routing.only`, else
`provider.routing.order`; with none of them the battery is first bought on the route as
configured, and the providers that answered are the ones probed (discovery). An answer from
a provider the probes did not cover (the route changed) stops dispatch; generate probes it
and resumes. A provider that declares its profile (`provider.serving_profile`, as the local
embedded server does) is not probed. Where nothing can be concluded (no battery for the
model, no provider answered, no provider usable) the job stops before buying any answer,
unless a profile is named (`serving=NAME`).

Why about 600 lines: `serving=auto` is one flow read top to bottom (verdict cache, the
battery bought per provider, the profile fitted, the route pinned); the answer checks are in
checks.py and the battery and profile fitting in probe.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kimi_pipe.conformance.probe import (
    Battery,
    ProbeError,
    Shortfall,
    default_battery,
    judge,
    load_battery,
    load_serving_fields,
    profile_spec,
    write_probe_prompts,
)
from kimi_pipe.core.serving import CHOICES, UNKNOWN, ServingProfile
from kimi_pipe.errors import ConfigError
from kimi_pipe.store.layout import PROBE_PROMPTS, RECORDS, SERVING_AUTO_DIR, SERVING_AUTO_RUN
from kimi_pipe.store.records import iter_records
from kimi_pipe.store.spend_journal import JOURNAL, SpendJournal

log = logging.getLogger("kimi_pipe.serving_auto")

# How a battery is bought: (the job buying it, battery, prompts file, provider slug or None
# for the route, USD cap, run dir) -> (records, what did not fit). The generate job passes
# generation/probes.py's `buy_battery` and itself: this module never imports that job.
BuyBattery = Callable[
    [Any, Battery, Path, str | None, float, Path], tuple[list[dict[str, Any]], Shortfall | None]
]

AUTO = "auto"
RUN_FILE = SERVING_AUTO_RUN
PROBE_DIR = SERVING_AUTO_DIR
ROUTE_RUN = "_route"  # the discovery run: the battery on the route as configured
INTENT_PREFIX = "serving_auto:"  # journal ids of probe bookings (never a prompt's id)
MAX_ROUTE_CHANGES = 4  # re-probes per generate call before it gives up


@dataclass(frozen=True)
class AutoSettings:
    """The `serving_auto` config node (conf/config.yaml says what each setting does)."""

    providers: list[str] | None = None
    usd_per_provider: float | None = None
    cache_days: float | None = 7
    cache_dir: str | None = None
    battery: str | None = None


@dataclass(frozen=True)
class AutoTarget:
    """What serving=auto reads of the job it fits a route for."""

    model_name: str  # model.name: its battery is conf/probes/<model_name>.yaml
    provider_model: str  # provider.model and provider.api_base: the verdict cache's key
    api_base: str
    routing: Mapping[str, Any]  # provider.routing as configured
    serving: ServingProfile  # the job's `serving`
    declared: str | None  # provider.serving_profile: a provider that declares its profile
    budget_usd: float | None  # budget.usd: the probes count in it
    auto: AutoSettings = field(default_factory=AutoSettings)


@dataclass(frozen=True)
class Pin:
    """How `prepare` changes the job: the serving profile it runs under and, after a fit,
    the providers it is pinned to (routing only/order, no fallbacks; None: unchanged)."""

    serving: ServingProfile
    order: list[str] | None = None


class ServingAutoError(ConfigError):
    """serving=auto cannot conclude a profile for the route (exit 2, before any answer)."""


# ---------------------------------------------------------------------------------------
# Profile specs: NAME or NAME+FIELD=VALUE+... (what records carry as `serving_profile`)


@functools.lru_cache(maxsize=256)
def profile_from_spec(spec: str) -> ServingProfile:
    """The ServingProfile a spec names (conf/serving/NAME.yaml plus its field overrides)."""

    base, *parts = str(spec).split("+")
    try:
        fields_ = load_serving_fields(base)
    except ProbeError as exc:
        raise ConfigError(f"serving profile {spec!r}: {exc}") from None
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in CHOICES:
            raise ConfigError(f"serving profile {spec!r}: bad part {part!r} (FIELD=VALUE)")
        fields_[key] = value
    try:
        return ServingProfile.from_config({**fields_, "name": spec})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def spec_overrides(spec: str) -> list[str]:
    """The command line that names the same profile: `serving=NAME serving.FIELD=VALUE`."""
    base, *parts = str(spec).split("+")
    return [f"serving={base}", *(f"serving.{p}" for p in parts)]


# ---------------------------------------------------------------------------------------
# The route: which profile each provider's answers are reconstructed with


@dataclass
class ProviderFit:
    provider: str
    profile: str | None  # spec; None: no profile undoes what the probes saw
    usable: bool
    why: str
    fields: dict[str, str]
    probed_at: float  # unix time of the probe answers (a cached verdict keeps its own)
    source: str  # "probed" | "cache"
    usd: float  # what this job spent on it
    conformance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "profile": self.profile,
            "serving_overrides": spec_overrides(self.profile) if self.profile else None,
            "usable": self.usable,
            "why": self.why,
            "fields": self.fields,
            "probed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.probed_at)),
            "probed_at_unix": self.probed_at,
            "source": self.source,
            "usd": self.usd,
            "conformance": self.conformance,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str | None = None) -> ProviderFit:
        return cls(
            provider=str(data["provider"]),
            profile=data.get("profile"),
            usable=bool(data.get("usable")),
            why=str(data.get("why") or ""),
            fields=dict(data.get("fields") or {}),
            probed_at=float(data.get("probed_at_unix") or 0.0),
            source=source or str(data.get("source") or "probed"),
            usd=0.0 if source == "cache" else float(data.get("usd") or 0.0),
            conformance=dict(data.get("conformance") or {}),
        )


@dataclass
class Route:
    """Per provider, the profile its answers are reconstructed with and the evidence."""

    fits: dict[str, ProviderFit] = field(default_factory=dict)
    declared: str | None = None  # one profile (its spec) for every provider
    declared_by: str | None = None  # "serving=NAME" | "provider.serving_profile"
    declared_profile: ServingProfile | None = None

    def covers(self, provider: Any) -> bool:
        if self.declared is not None:
            return True
        return str(provider) in self.fits  # probed (an unusable one gets nothing declared)

    def profile_for(self, provider: Any) -> tuple[ServingProfile, str, str | None]:
        """(profile, spec, probe reference) for an answer of `provider`; a provider the
        probes did not cover gets nothing declared (unknown: flagged, never guessed)."""
        if self.declared is not None:
            profile = self.declared_profile or profile_from_spec(self.declared)
            return profile, self.declared, self.declared_by
        fit = self.fits.get(str(provider))
        if fit is None:
            return profile_from_spec(UNKNOWN), UNKNOWN, f"not probed: {provider}"
        ref = f"{RUN_FILE}#{fit.provider}"
        if not fit.usable or fit.profile is None:
            return profile_from_spec(UNKNOWN), UNKNOWN, f"{ref} (not usable: {fit.why})"
        return profile_from_spec(fit.profile), fit.profile, ref

    def usable(self) -> list[ProviderFit]:
        return [f for f in self.fits.values() if f.usable]


def named(profile: ServingProfile) -> Route:
    """The route of a job that names its profile (serving=NAME [serving.FIELD=VALUE]):
    no probes; records carry NAME plus the fields overridden on the command line."""

    try:
        base = profile_from_spec(profile.name)
        name = profile.name
    except ConfigError:  # an inline profile: its fields say what it is
        base, name = ServingProfile(), UNKNOWN
    differ = {k: getattr(profile, k) for k in CHOICES if getattr(profile, k) != getattr(base, k)}
    return Route(
        declared=profile_spec(name, differ),
        declared_by=f"serving={profile.name}",
        declared_profile=profile,
    )


# ---------------------------------------------------------------------------------------
# Cache of verdicts


def cache_dir(auto: AutoSettings) -> Path:
    configured = auto.cache_dir
    if configured:
        return Path(str(configured))
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "kimi_pipe" / "probes"


def _cache_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]


class VerdictCache:
    def __init__(self, target: AutoTarget, battery_sha: str) -> None:
        self.dir = cache_dir(target.auto)
        days = target.auto.cache_days
        self.lifetime_s = None if days is None else float(days) * 86400.0
        self.model = target.provider_model
        self.api_base = target.api_base
        self.battery_sha = battery_sha

    def _path(self, kind: str, what: Any) -> Path:
        key = _cache_key(kind, what, self.model, self.api_base, self.battery_sha)
        label = _safe(what) if isinstance(what, str) else kind
        return self.dir / f"{label}-{key}.json"

    def _get(self, path: Path) -> dict[str, Any] | None:
        if self.lifetime_s is not None and self.lifetime_s <= 0:
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        age = time.time() - float(data.get("saved_unix") or 0.0)
        if self.lifetime_s is not None and age > self.lifetime_s:
            return None
        return data

    def _put(self, path: Path, data: dict[str, Any]) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            tmp.write_text(json.dumps({**data, "saved_unix": time.time()}, indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:  # a read-only home must not stop a paid job
            log.warning("serving=auto: verdict cache not written (%s)", exc)

    def fit(self, provider: str) -> ProviderFit | None:
        data = self._get(self._path("provider", provider))
        return None if data is None else ProviderFit.from_json(data["fit"], source="cache")

    def put_fit(self, fit: ProviderFit) -> None:
        self._put(self._path("provider", fit.provider), {
            "provider": fit.provider, "model": self.model, "api_base": self.api_base,
            "battery_sha": self.battery_sha, "fit": fit.to_json()})  # fmt: skip

    def route(self, routing: Any) -> list[str] | None:
        data = self._get(self._path("route", routing))
        return None if data is None else [str(p) for p in data.get("providers") or []]

    def put_route(self, routing: Any, providers: Sequence[str]) -> None:
        self._put(self._path("route", routing), {"routing": routing, "providers": list(providers)})


# ---------------------------------------------------------------------------------------
# Probing, booked in the job's journal


class _Prober:
    def __init__(
        self, target: AutoTarget, run_dir: Path, buy: BuyBattery | None = None, job: Any = None
    ) -> None:
        self.target, self.run_dir, self.buy_battery, self.job = target, run_dir, buy, job
        given = target.auto.battery
        path = Path(given) if given else default_battery(target.model_name)
        if not path.is_file():
            raise ServingAutoError(
                f"serving=auto: no probe battery for model {target.model_name!r} ({path}), so "
                "nothing can be concluded about the route; name a profile: serving=NAME "
                "(conf/serving, docs/serving_profiles.md), or give serving_auto.battery=PATH"
            )
        self.battery = load_battery(path)
        self.battery_sha = battery_sha(path)
        self.cache = VerdictCache(target, self.battery_sha)
        self.base = run_dir / PROBE_DIR
        self.prompts = self.base / PROBE_PROMPTS
        write_probe_prompts(self.battery, self.prompts)
        usd = target.auto.usd_per_provider
        self.cap = float(usd) if usd is not None else self.battery.usd_each
        self.cap_key = (
            f"serving_auto.usd_per_provider={self.cap:g}"
            if usd is not None
            else f"the battery's usd_each ${self.cap:g} (serving_auto.usd_per_provider unset)"
        )
        # Batteries (by run name) that the budget cut short: (shortfall or None when
        # nothing was left to buy any, which cap bound, what the job had spent).
        self.short: dict[str, tuple[Shortfall | None, str, float]] = {}

    def _cap_left(self) -> tuple[float, str, float]:
        """This probe's cap: serving_auto.usd_per_provider within what budget.usd leaves;
        with the setting that bound it and what the job's journal had spent."""

        cap_usd = self.target.budget_usd
        if cap_usd is None:
            return self.cap, self.cap_key, 0.0
        with SpendJournal(self.run_dir / JOURNAL) as journal:
            spent = journal.spent()
        left = float(cap_usd) - spent
        if left < self.cap:
            return max(0.0, left), f"budget.usd={float(cap_usd):g}", spent
        return self.cap, self.cap_key, spent

    def buy(self, slug: str | None) -> tuple[list[dict[str, Any]], float]:
        """Buy the battery (pinned to slug, or on the route) booked in the job's journal;
        returns (records, USD this call spent)."""
        buy_battery = self.buy_battery
        if buy_battery is None:  # a caller that never probes (a declared profile) passes none
            raise ServingAutoError("serving=auto must buy probes here, and no buyer was given")

        name = slug or ROUTE_RUN
        run = self.base / _safe(name)
        cap, bound_by, spent = self._cap_left()
        rid = INTENT_PREFIX + name
        with SpendJournal(self.run_dir / JOURNAL) as journal:
            booked = sum(
                (i.cost if i.cost is not None else i.usd)
                for i in journal.intents.values()
                if i.id == rid
            )
            # Write-ahead, at the cap: a kill during the probes leaves it booked at its worst.
            seq = journal.intent(rid, 1, cap)
        records: list[dict[str, Any]] = []
        try:
            short: Shortfall | None = None
            if cap > 0:
                records, short = buy_battery(self.job, self.battery, self.prompts, slug, cap, run)
            if cap <= 0 or short is not None:
                self.short[name] = (short, bound_by, spent)
        finally:
            probe_journal = run / JOURNAL
            spent_there = 0.0
            if probe_journal.exists():
                with SpendJournal(probe_journal) as pj:
                    spent_there = pj.spent()
            cost = max(0.0, spent_there - booked)
            with SpendJournal(self.run_dir / JOURNAL) as journal:
                journal.settle(seq, cost, cost > 0)
        log.info("serving=auto: battery on %s: %d answers, $%.6f", name, len(records), cost)
        return records, cost

    def budget_message(self, fits: Mapping[str, ProviderFit]) -> str:
        """Why no provider was found usable where the budget cut probes short: its figures
        (the amounts it compared) and what to change, in one line."""
        name, (short, bound_by, spent) = next(iter(self.short.items()))
        where = "the route as configured" if name == ROUTE_RUN else name
        by_budget = bound_by.startswith("budget.usd")
        raise_it = "raise budget.usd" if by_budget else "raise serving_auto.usd_per_provider"
        if short is None:
            what = f"{bound_by} left nothing for them (the job has spent ${spent:.4f})"
            at_least = f" above ${spent:.4f}" if by_budget else ""
        else:
            what = f"on {where}, {short.describe(bound_by)}"
            # Enough for one probe at a time (as the budget holds it), beyond what is spent.
            at_least = f" to at least ${(spent if by_budget else 0.0) + short.held_usd:.4f}"
        others = "; ".join(
            f"{f.provider}: {f.why}" for f in fits.values() if f.provider not in self.short
        )
        return (
            f"serving=auto: the probes did not fit the budget: {what}"
            + (f" (the providers probed: {others})" if others else "")
            + f". Nothing was bought beyond the probes; {raise_it}{at_least}, or name a "
            "profile to skip the probes: serving=NAME (conf/serving, docs/serving_profiles.md)"
        )

    def judge(self, slug: str, records: list[dict[str, Any]], usd: float) -> ProviderFit:

        return remember(self.cache, judge(self.battery, slug, records), usd)


def fit_of(conf: Any, usd: float) -> ProviderFit:
    """A provider's fit from the probe stage's ProviderConformance."""
    return ProviderFit(
        provider=conf.provider,
        profile=conf.profile,
        usable=conf.usable,
        why=conf.why,
        fields=conf.fields,
        probed_at=time.time(),
        source="probed",
        usd=usd,
        conformance=conf.to_json(),
    )


def battery_sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def remember(cache: VerdictCache, conf: Any, usd: float) -> ProviderFit:
    fit = fit_of(conf, usd)
    if conf.answered:
        cache.put_fit(fit)  # nothing answered proves nothing: not cached
    return fit


def cache_conformance(target: AutoTarget, battery_path: Path, results: Sequence[Any]) -> None:
    """The probe stage's verdicts into the cache, so a generate job after a sweep's probes
    buys no battery again."""
    cache = VerdictCache(target, battery_sha(battery_path))
    for conf in results:
        remember(cache, conf, 0.0)


def _providers_of(records: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if not rec.get("error") and rec.get("provider"):
            out.setdefault(str(rec["provider"]), []).append(dict(rec))
    return out


def _configured_providers(target: AutoTarget) -> list[str] | None:
    routing = target.routing or {}
    for value in (target.auto.providers, routing.get("only"), routing.get("order")):
        if value:
            return [str(v) for v in value]
    return None


def _read_run_file(run_dir: Path) -> dict[str, ProviderFit]:
    try:
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: ProviderFit.from_json(v) for k, v in (data.get("providers") or {}).items()}


def _answered_providers(run_dir: Path) -> list[str]:

    path = run_dir / RECORDS
    if not path.exists():
        return []
    seen = {
        str(r["provider"]) for r in iter_records(path) if r.get("provider") and not r.get("error")
    }
    return sorted(seen)


def fit_route(
    target: AutoTarget, run_dir: Path, buy: BuyBattery | None = None, job: Any = None
) -> Route:
    """Probe (or read from cache, or from this run's earlier fit) every provider the job
    will use; raises ServingAutoError where nothing can be concluded. `job` is what `buy`
    is given to buy a battery like it."""
    prober = _Prober(target, run_dir, buy, job)
    earlier = _read_run_file(run_dir)  # a resumed job keeps what it measured
    fits: dict[str, ProviderFit] = {}
    wanted = _configured_providers(target)
    if wanted is None and earlier:
        wanted = list(earlier)  # a resumed job whose route was discovered
    if wanted is None:
        routing = dict(target.routing or {})
        wanted = prober.cache.route(routing)
        if not wanted:
            records, usd = prober.buy(None)
            by_provider = _providers_of(records)
            share = usd / max(1, len(records))
            for slug, recs in by_provider.items():
                # A provider that answered every probe is judged on them; the others get
                # the whole battery pinned to them below.
                if {r.get("id") for r in recs} >= {p["id"] for p in prober.battery.probes}:
                    fits[slug] = prober.judge(slug, recs, share * len(recs))
            wanted = sorted(by_provider)
            if wanted:
                prober.cache.put_route(routing, wanted)
    # Providers that answered this run without being asked for: the route changed.
    for slug in _answered_providers(run_dir):
        if slug not in wanted:
            log.warning("serving=auto: %s answered but was not probed: probing it now", slug)
            wanted = [*wanted, slug]
    for slug in wanted:
        if slug in fits:
            continue
        if slug in earlier:
            fits[slug] = earlier[slug]
            continue
        cached = prober.cache.fit(slug)
        if cached is not None:
            fits[slug] = cached
            continue
        records, usd = prober.buy(slug)
        fits[slug] = prober.judge(slug, records, usd)
    route = Route(fits=fits)
    _write_run_file(run_dir, prober, route, wanted)
    if not route.usable() and prober.short:
        raise ServingAutoError(prober.budget_message(fits))
    if not route.usable():
        why = "; ".join(f"{f.provider}: {f.why}" for f in fits.values()) or "no provider answered"
        raise ServingAutoError(
            "serving=auto: no provider of the route has a serving profile that undoes what "
            f"its probes saw ({why}); see {run_dir / RUN_FILE}. Nothing was bought beyond the "
            "probes; name a profile to buy anyway (serving=NAME) or route elsewhere "
            "(provider.routing.only=[...])"
        )
    return route


def _write_run_file(run_dir: Path, prober: _Prober, route: Route, wanted: list[str]) -> None:
    data = {
        "battery": str(prober.battery.source),
        "battery_sha": prober.battery_sha,
        "model": prober.cache.model,
        "providers_wanted": wanted,
        "pinned": [f.provider for f in route.usable()],
        "providers": {k: v.to_json() for k, v in route.fits.items()},
        "probe_runs": str(run_dir / PROBE_DIR),
        "cache_dir": str(prober.cache.dir),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (RUN_FILE + ".partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(run_dir / RUN_FILE)


def pinned(target: AutoTarget, route: Route) -> Pin:
    """The job pinned to the route's usable providers (in the order asked for), no
    fallbacks, with `serving` set to the first one's fitted profile (records carry each
    provider's own)."""
    usable = [f.provider for f in route.usable()]
    wanted = _configured_providers(target) or []
    order = [p for p in wanted if p in usable] + [p for p in usable if p not in wanted]
    first = route.fits[order[0]]
    return Pin(serving=profile_from_spec(str(first.profile)), order=order)


def is_plain_auto(profile: ServingProfile) -> bool:
    """serving=auto with no field set on the command line (`serving=auto
    serving.reasoning_tail=kept` declares that field: it is a named profile)."""
    return profile.name == AUTO and all(getattr(profile, k) == UNKNOWN for k in CHOICES)


def prepare(
    target: AutoTarget, run_dir: Path, buy: BuyBattery | None = None, job: Any = None
) -> tuple[Route, Pin | None]:
    """generate's first step: the route every record of the job is reconstructed under, and
    how the job changes for it (None: not at all); `buy` buys a probe battery like `job`
    where one must be bought (the generate job passes both)."""

    profile = target.serving
    if not is_plain_auto(profile):
        return named(profile), None
    declared = target.declared
    if declared:
        profile = profile_from_spec(str(declared))
        route = Route(
            declared=str(declared), declared_by="provider.serving_profile", declared_profile=profile
        )
        return route, Pin(serving=replace(profile, name=str(declared)))
    route = fit_route(target, run_dir, buy, job)
    return route, pinned(target, route)


def recorded_profile(record: Mapping[str, Any]) -> ServingProfile | None:
    """The profile a stored record was reconstructed under (None: it names none)."""
    spec = record.get("serving_profile")
    return profile_from_spec(str(spec)) if isinstance(spec, str) and spec else None


__all__ = [
    "AUTO",
    "AutoSettings",
    "AutoTarget",
    "Pin",
    "RUN_FILE",
    "ProviderFit",
    "Route",
    "ServingAutoError",
    "fit_route",
    "prepare",
    "profile_from_spec",
    "recorded_profile",
    "spec_overrides",
]
