r"""Conformance probes: the battery (`conf/probes/<model>.yaml`: small prompts, each built so
that one server transformation shows in the answer), the deterministic check of each answer,
the verdicts per provider (clean, seen, unknown) and the serving profile that fits. Bought
through kimi_pipe/generation/probes.py; the command is kimi_pipe/stages/probe.py.

The answer checks are conformance/checks.py; this module (about 520 lines) keeps the
battery, the verdicts and the profile they fit, which change together when a probe is added.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml import YAMLError

from kimi_pipe.config import CONF_DIR
from kimi_pipe.conformance.checks import (  # noqa: F401  (check_answer: re-exported)
    CLEAN,
    NATIVE_ID,
    SEEN,
    UNKNOWN,
    Verdicts,
    check_answer,
    message_of,
    tool_calls_of,
)
from kimi_pipe.core.issue_codes import Code
from kimi_pipe.core.serving import CHOICES
from kimi_pipe.core.serving import UNKNOWN as PROFILE_UNKNOWN  # a profile field's, not a verdict's
from kimi_pipe.errors import ConfigError
from kimi_pipe.providers.money import usd_pair
from kimi_pipe.store import atomic
from kimi_pipe.store.layout import CONFORMANCE_JSON, CONFORMANCE_MD


class ProbeError(ConfigError):
    """A bad battery or argument, with a message that says how to fix it."""


@dataclass(frozen=True)
class Quirk:
    name: str
    invertible: bool
    what: str


@dataclass(frozen=True)
class Battery:
    name: str
    source: Path
    max_tokens: int
    usd_each: float
    quirks: dict[str, Quirk]
    # conf/serving profile names the fit may report, in order of preference
    profiles: tuple[str, ...]
    probes: list[dict[str, Any]]


CHECKS = (
    "begins_with",
    "keeps_text",
    "ends_with_newline",
    "reasoning_trailing_whitespace",
    "argument_edges",
    "string_argument",
    "tool_index",
    "tool_name",
    "no_reasoning",
)


def load_battery(path: Path) -> Battery:
    """Read and check a battery file; errors name the file and the probe."""

    if not path.is_file():
        raise ProbeError(f"probe battery {path} not found; name one: probe.battery=PATH.yaml")

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (YAMLError, UnicodeDecodeError) as exc:
        why = str(exc).split("\n", 1)[0]
        raise ProbeError(f"probe battery {path} is not readable YAML: {why}") from None
    if not isinstance(data, dict):
        raise ProbeError(f"{path}: not a mapping")
    quirks = {
        name: Quirk(name, bool(q.get("invertible")), str(q.get("what") or ""))
        for name, q in (data.get("quirks") or {}).items()
    }
    listed = data.get("profiles") or []
    if not isinstance(listed, list):
        raise ProbeError(f"{path}: profiles must be a list of conf/serving profile names")
    profiles = tuple(str(name) for name in listed)
    missing = [n for n in profiles if not (CONF_DIR / "serving" / f"{n}.yaml").is_file()]
    if missing:
        raise ProbeError(f"{path}: profiles {missing} are not in {CONF_DIR / 'serving'}")
    probes = list(data.get("probes") or [])
    seen_ids: set[str] = set()
    for i, probe in enumerate(probes):
        pid = probe.get("id") if isinstance(probe, dict) else None
        where = f"{path}: probe {i} ({pid or 'no id'})"
        if not pid or pid in seen_ids:
            raise ProbeError(f"{where}: every probe needs a unique id")
        seen_ids.add(pid)
        if not isinstance(probe.get("messages"), list) or not probe["messages"]:
            raise ProbeError(f"{where}: messages must be a non-empty list")
        kind = (probe.get("check") or {}).get("kind")
        if kind not in CHECKS:
            raise ProbeError(f"{where}: check.kind {kind!r} is not one of {CHECKS}")
    if not probes:
        raise ProbeError(f"{path}: no probes")
    return Battery(
        name=str(data.get("name") or path.stem),
        source=path,
        max_tokens=int(data.get("max_tokens") or 2048),
        usd_each=float(data.get("usd_each") or 0.05),
        quirks=quirks,
        profiles=profiles,
        probes=probes,
    )


# ---------------------------------------------------------------------------------------
# Verdicts -> serving-profile fields (conf/serving: one vocabulary for probes and profiles)

# quirk -> (conf/serving field, its value when the quirk is seen, when it is clean)
QUIRK_FIELDS: dict[str, tuple[str, str | None, str]] = {
    "marker_spacing": ("marker_spacing", "spaces", "none"),
    "reasoning_whitespace_stripped": ("reasoning_tail", "stripped", "kept"),
    "think_end_dropped": ("think_end", "dropped", "kept"),
    "dotted_name_truncated": ("tool_names", "last_dot_part", "full"),
    "argument_edges_stripped": ("argument_edges", "stripped", "kept"),
    # Seen as a typed value: coerced; seen as re-spaced JSON: no field says that (None).
    "argument_reserialised": ("argument_types", None, "verbatim"),
}


def observed_fields(
    probe: Mapping[str, Any], record: Mapping[str, Any], verdicts: Verdicts
) -> dict[str, str]:
    """What one answered probe says about the conf/serving fields (absent: nothing)."""
    out: dict[str, str] = {}
    for quirk, (verdict, why) in verdicts.items():
        if quirk not in QUIRK_FIELDS:
            continue
        name, seen, clean = QUIRK_FIELDS[quirk]
        if verdict == CLEAN:
            out[name] = clean
        elif verdict == SEEN and seen is not None:
            out[name] = seen
        elif verdict == SEEN and quirk == "argument_reserialised" and "came back as" in why:
            out[name] = "coerced"
    if probe["check"]["kind"] == "tool_index":
        out |= _tool_id_rule(probe, record, verdicts)
    return out


def _tool_id_rule(
    probe: Mapping[str, Any], record: Mapping[str, Any], verdicts: Verdicts
) -> dict[str, str]:
    """Who wrote the tool-call id: the conversation counter, SGLang 0.5.14's double count,
    a count from 0 per answer, or a foreign id (docs/serving_profiles.md)."""
    if verdicts.get("foreign_tool_ids", ("", ""))[0] == SEEN:
        return {"tool_call_ids": "foreign"}
    rule = verdicts.get("tool_index_rule")
    if rule is None:
        return {}
    if rule[0] == CLEAN:
        # The model's own id and a rebuilt conversation counter look alike: `conversation`
        # checks every id against the counter, so a stack that rebuilds cannot fool it.
        return {"tool_call_ids": "conversation"}
    spec = probe["check"]
    calls = tool_calls_of(message_of(record))
    for position, call in enumerate(calls):
        if (call.get("function") or {}).get("name") != spec["tool"]:
            continue
        match = NATIVE_ID.match(str(call.get("id") or "").strip())
        index = int(match["index"]) if match else None
        history = int(spec["index"]) - position  # the calls before this answer
        if index == history + int(spec["index"]):
            return {"tool_call_ids": "double_count"}
        if index == position:
            return {"tool_call_ids": "per_answer"}
    return {}


def fit_profile(battery: Battery, fields: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The conf/serving profile the measured fields name: the first listed one that equals
    them, else the closest listed one and the fields that differ (`serving=BASE
    serving.FIELD=VALUE`). Returns (spec, full fields); spec is `BASE` or
    `BASE+FIELD=VALUE+...`, what records carry as `serving_profile`."""
    want = {name: fields.get(name, PROFILE_UNKNOWN) for name in CHOICES}
    best: tuple[int, int, str, dict[str, str]] | None = None
    for rank, name in enumerate(battery.profiles):
        have = load_serving_fields(name)
        differ = {k: v for k, v in want.items() if have.get(k, PROFILE_UNKNOWN) != v}
        if best is None or (len(differ), rank) < best[:2]:
            best = (len(differ), rank, name, differ)
    if best is None:
        plain = set(want.values()) == {PROFILE_UNKNOWN}
        return "unknown" if plain else profile_spec("unknown", want), want
    return profile_spec(best[2], best[3]), want


def profile_spec(base: str, overrides: Mapping[str, str]) -> str:
    """`BASE` or `BASE+FIELD=VALUE+...` (fields in conf/serving order)."""
    parts = [f"{k}={overrides[k]}" for k in CHOICES if k in overrides]
    return "+".join([base, *parts])


def load_serving_fields(name: str) -> dict[str, str]:
    """The fields of conf/serving/NAME.yaml."""

    path = CONF_DIR / "serving" / f"{name}.yaml"
    if not path.is_file():
        raise ProbeError(f"serving profile {name!r} not found in {path.parent}")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ProbeError(f"serving profile {name!r}: {path} is not a mapping")
    return {str(k): str(v) for k, v in data.items() if k not in ("name", "description", "source")}


# ---------------------------------------------------------------------------------------
# A provider's verdicts


@dataclass
class ProviderConformance:
    provider: str
    answered: int = 0
    probes: int = 0
    quirks: dict[str, str] = field(default_factory=dict)  # quirk -> clean/seen/unknown
    evidence: dict[str, list[str]] = field(default_factory=dict)
    logprobs: str = "none"  # none | content | whole | mixed
    logprob_answers: int = 0
    logprob_agree: int = 0  # answers whose engine tokens join to the answer text
    logprob_mismatch: int = 0
    noncanonical_splits: int = 0
    issues: Counter[str] = field(default_factory=Counter)
    fields: dict[str, str] = field(default_factory=dict)  # conf/serving field -> measured
    profile: str | None = None  # conf/serving spec: NAME or NAME+FIELD=VALUE+...
    usable: bool = False
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "answered": self.answered,
            "probes": self.probes,
            "quirks": self.quirks,
            "evidence": self.evidence,
            "logprobs": self.logprobs,
            "logprob_answers": self.logprob_answers,
            "logprob_agree": self.logprob_agree,
            Code.LOGPROB_MISMATCH: self.logprob_mismatch,
            "noncanonical_splits": self.noncanonical_splits,
            "issues": dict(self.issues),
            "fields": self.fields,
            "profile": self.profile,
            "usable": self.usable,
            "why": self.why,
        }


def judge(
    battery: Battery, provider: str, records: Sequence[Mapping[str, Any]]
) -> ProviderConformance:
    """Verdicts over all answered probes: seen beats clean beats unknown."""
    by_id = {p["id"]: p for p in battery.probes}
    out = ProviderConformance(provider, probes=len(battery.probes))
    verdicts: dict[str, set[str]] = {q: set() for q in battery.quirks}
    observed: dict[str, set[str]] = {}
    coverages: set[str] = set()
    position = {pid: i for i, pid in enumerate(by_id)}
    # Battery order, whatever order the answers came back in: the table is reproducible.
    ordered = sorted(records, key=lambda r: position.get(r.get("id"), len(position)))
    for rec in ordered:
        probe = by_id.get(rec.get("id"))
        if probe is None or rec.get("error"):
            continue
        out.answered += 1
        out.issues.update(rec.get("issues") or [])
        found = check_answer(probe, rec)
        for quirk, (verdict, why) in found.items():
            verdicts.setdefault(quirk, set()).add(verdict)
            out.evidence.setdefault(quirk, []).append(f"{probe['id']}: {verdict}: {why}")
        for name, value in observed_fields(probe, rec, found).items():
            observed.setdefault(name, set()).add(value)
        lp = rec.get("logprobs") or {}
        if lp.get("present"):
            out.logprob_answers += 1
            coverages.add(str(lp.get("coverage") or "invalid"))
            if "mismatch" in lp:
                out.logprob_mismatch += 1
            elif "invalid" not in lp:
                out.logprob_agree += 1
            out.noncanonical_splits += len(lp.get("splits") or [])
    for quirk, seen in verdicts.items():
        out.quirks[quirk] = SEEN if SEEN in seen else CLEAN if CLEAN in seen else UNKNOWN
    out.logprobs = "none" if not coverages else coverages.pop() if len(coverages) == 1 else "mixed"
    # Two answers that disagree about a field prove neither value: unknown (flag, not guess).
    out.fields = {k: v.pop() for k, v in sorted(observed.items()) if len(v) == 1}
    _decide(battery, out)
    return out


def _decide(battery: Battery, out: ProviderConformance) -> None:
    seen = {q for q, v in out.quirks.items() if v == SEEN}
    stuck = sorted(q for q in seen if q in battery.quirks and not battery.quirks[q].invertible)
    if out.answered == 0:
        out.why = "no probe was answered"
        return
    if stuck:
        out.why = f"quirks that cannot be inverted: {', '.join(stuck)}"
        return
    out.profile, out.fields = fit_profile(battery, out.fields)
    out.usable = True
    unknown = sorted(q for q, v in out.quirks.items() if v == UNKNOWN)
    out.why = f"profile {out.profile}" + (
        f"; not measured: {', '.join(unknown)}" if unknown else ""
    )


# ---------------------------------------------------------------------------------------
# Table


def render_table(battery: Battery, results: Sequence[ProviderConformance]) -> str:
    quirks = list(battery.quirks)
    head = ["provider", *quirks, "logprobs", "token agreement", "profile", "use"]
    lines = [
        f"# Conformance: {battery.name} ({battery.source.name})",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
    ]
    for r in results:
        agree = f"{r.logprob_agree}/{r.logprob_answers}" if r.logprob_answers else "n/a"
        cells = [
            r.provider,
            *(r.quirks.get(q, UNKNOWN) for q in quirks),
            r.logprobs,
            agree,
            r.profile or "none",
            "yes" if r.usable else "no",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Why:", ""]
    lines += [f"- `{r.provider}`: {r.why}" for r in results]
    lines += ["", "Quirks:", ""]
    lines += [
        f"- `{q.name}` ({'invertible' if q.invertible else 'not invertible'}): {q.what}"
        for q in battery.quirks.values()
    ]
    lines += ["", "Evidence:", ""]
    for r in results:
        for quirk, items in r.evidence.items():
            lines += [f"- `{r.provider}` {quirk}: " + "; ".join(items)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Running


def write_probe_prompts(battery: Battery, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for probe in battery.probes:
            row = {"id": probe["id"], "messages": probe["messages"]}
            if probe.get("tools"):
                row["tools"] = probe["tools"]
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class Shortfall:
    """Probes of a battery run that did not fit the budget they were bought under (the
    generate summary's `this_run.over_budget`): what a message saying so names."""

    skipped: int  # probes not bought for the budget
    answered: int  # probes this run bought
    worst_usd: float  # the skipped probes' worst cases together (reserve_factor included)
    held_usd: float  # the smallest of them as the budget held it (x budget.overbill_guard)
    left_usd: float  # what the budget had left for them
    hold: str  # why held above the worst case ("held at 3.00x (...)"; "" when not)

    @classmethod
    def of(cls, summary: Mapping[str, Any]) -> Shortfall | None:
        this_run = summary.get("this_run") or {}
        over = this_run.get("over_budget")
        if not over:
            return None
        return cls(
            skipped=int(this_run.get("skipped_over_budget") or 0),
            answered=int(this_run.get("answered") or 0),
            worst_usd=float(over["worst_usd"]),
            held_usd=float(over["held_usd"]),
            left_usd=float(over["left_usd"]),
            hold=str(over.get("hold") or ""),
        )

    def describe(self, bound_by: str = "the budget") -> str:
        """`N probes not bought (...); the cheapest, held at ..., needs $H, more than the
        $L left of <bound_by>`: the amounts the budget compared."""
        held, left = usd_pair(self.held_usd, self.left_usd)
        how = f", {self.hold}," if self.hold else ""
        return (
            f"{self.skipped} probes not bought (worst case ${self.worst_usd:.4f} in all); the "
            f"cheapest{how} needs {held}, more than the {left} left of {bound_by}"
        )


# Settings that belong to the battery, not to the command that asked for the probes (a
# sweep's dataset, budget and serving profile): left out of the overrides the probes take.
NOT_THE_PROBES = ("dataset", "budget", "serving")


def probe_overrides(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith(NOT_THE_PROBES)]


def write_conformance(
    out_dir: Path, battery: Battery, results: Sequence[ProviderConformance]
) -> None:
    data = {"battery": str(battery.source), "providers": [r.to_json() for r in results]}
    atomic.write_text(out_dir / CONFORMANCE_JSON, json.dumps(data, indent=2) + "\n")
    atomic.write_text(out_dir / CONFORMANCE_MD, render_table(battery, results))


# ---------------------------------------------------------------------------------------
# The stage: settings, entry, command line

SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")  # OpenRouter slugs, e.g. deepinfra/fp8


@dataclass
class ProbeSettings:
    """The `probe` config node (conf/probe/default.yaml)."""

    providers: list[str] = field(default_factory=list)
    usd: float | None = None
    output_dir: str = "runs/probe"
    battery: str | None = None
    overrides: list[str] = field(default_factory=list)


def check_providers(providers: Sequence[str], key: str) -> None:
    """OpenRouter provider slugs, each once; a ConfigError naming `key` otherwise."""
    if not providers:
        raise ProbeError(f"{key}=[a,b,c] is required (OpenRouter provider slugs)")
    bad = [p for p in providers if not SLUG.match(p)]
    if bad:
        raise ProbeError(f"{key}: {bad} are not OpenRouter provider slugs (e.g. deepinfra/fp8)")
    twice = sorted({p for p in providers if list(providers).count(p) > 1})
    if twice:
        raise ProbeError(f"{key} names {twice} twice")


def check_settings(settings: ProbeSettings) -> ProbeSettings:
    """The `probe` settings as the probes need them: providers to probe, a cap that can buy."""
    check_providers(settings.providers, "probe.providers")
    if settings.usd is not None and settings.usd <= 0:
        raise ProbeError(f"probe.usd={settings.usd}: give a positive USD cap (or null)")
    return settings


def battery_of(model_name: str, settings: ProbeSettings | None = None) -> Battery:
    """The battery a probe run uses: `probe.battery`, else conf/probes/<model_name>.yaml."""
    given = settings.battery if settings is not None else None
    return load_battery(Path(given) if given else default_battery(model_name))


def default_battery(model_name: str) -> Path:
    return CONF_DIR / "probes" / f"{model_name}.yaml"
