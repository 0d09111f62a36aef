"""serving=auto: generate fits the serving profile from probes before buying (issue 19.4).

Everything over real HTTP against imitated stacks (tests/support/fake_stacks.py behind
tests/support/fake_openrouter.py), with the real Kimi tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.config import compose
from kimi_pipe.conformance.auto import (
    INTENT_PREFIX,
    RUN_FILE,
    prepare,
    profile_from_spec,
    spec_overrides,
)
from kimi_pipe.conformance.probe import default_battery, load_battery
from kimi_pipe.core.models import Model
from kimi_pipe.core.serving import CHOICES, serving_profile
from kimi_pipe.store.spend_journal import JOURNAL, SpendJournal
from tests.support.conftest_generate import (
    SERVING_AS_IS,
    base_overrides,
    read_jsonl,
    run_inprocess,
    write_prompts,
)
from tests.support.fake_openrouter import Behaviour, KimiCounter
from tests.support.fake_stacks import Stack, routed_fake, stacks

BATTERY = load_battery(default_battery("kimi_k25"))
PROBE_TEXTS = {
    next(m["content"] for m in reversed(p["messages"]) if m["role"] == "user")
    for p in BATTERY.probes
}


def _is_probe(body: dict[str, Any]) -> bool:
    users = [m.get("content") for m in body.get("messages") or [] if m.get("role") == "user"]
    return bool(users) and users[-1] in PROBE_TEXTS


class Switching(Stack):
    """Answers the probes itself; answers every other prompt through `other`, named as
    `other_name` by OpenRouter: the route changed under a pinned job."""

    other: Stack | None = None
    other_name: str = ""

    def completion(self, body: dict, behaviour: Any) -> tuple[dict, float, int, int]:
        if _is_probe(body) or self.other is None:
            return super().completion(body, behaviour)
        renamed = dataclasses.replace(behaviour, provider_name=self.other_name)
        return self.other.completion(body, renamed)


@pytest.fixture
def stack_server(kimi: Model) -> Any:
    counter = KimiCounter(kimi)
    all_stacks = stacks(kimi)
    # A stack that changes nothing and sends no logprobs (no sampled splits either: without
    # logprobs those cannot be seen): only a declared or fitted profile proves its ids.
    all_stacks["exact_plain"] = Stack(kimi, "exact_plain", splits=0)
    behaviours = {
        name: Behaviour(provider_name=name, counter=counter, stack=stack)
        for name, stack in all_stacks.items()
    }
    switching = Switching(kimi, "switching", logprobs="whole")
    switching.other, switching.other_name = all_stacks["exact_plain"], "exact_plain"
    behaviours["switching"] = Behaviour(provider_name="switching", counter=counter, stack=switching)
    # The route as configured (no provider named) reaches this one.
    default = Behaviour(
        provider_name="routed_exact",
        counter=counter,
        stack=Stack(kimi, "routed_exact", logprobs="whole"),
    )
    behaviours["routed_exact"] = default  # once named, it is pinned by that name
    srv = routed_fake(default, behaviours)
    yield srv, all_stacks
    srv.stop()


def _overrides(srv: Any, tmp: Path, out: Path, kimi_dir: Path, n: int = 4, **kw: Any) -> list[str]:
    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, n, tools_every=2, text=lambda i: f"Question {i}: call calc for {i}.")
    base = [
        o for o in base_overrides(prompts, srv.url(), out, kimi_dir, **kw) if o not in SERVING_AS_IS
    ]
    # A loaded machine must not turn answers into timeouts (retried, booked at worst case).
    return [
        *base,
        f"serving_auto.cache_dir={tmp / 'cache'}",
        "provider.concurrency=1",
        "provider.timeout_s=120",
    ]


def _probe_bills(srv: Any, slug: str | None = None) -> float:
    """USD the server billed for probe answers (of one behaviour, or all)."""
    return sum(b.cost for b in srv.bills if b.marker in PROBE_TEXTS and slug in (None, b.behaviour))


def _probe_intents(out: Path) -> dict[str, float]:
    with SpendJournal(out / JOURNAL) as journal:
        found: dict[str, float] = {}
        for intent in journal.intents.values():
            if intent.id.startswith(INTENT_PREFIX):
                found[intent.id] = found.get(intent.id, 0.0) + float(intent.cost or 0.0)
        return found


def test_auto_fits_each_stack_pins_the_job_and_books_the_probes(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    srv, truth = stack_server
    out = tmp_path / "run"
    asked = ["stripping", "exact_plain", "vllm_spaced", "sglang_0514", "exact_whole"]
    overrides = [
        *_overrides(srv, tmp_path, out, kimi_dir, usd=1.0),
        f"provider.routing.only=[{','.join(asked)}]",
        "serving_auto.usd_per_provider=0.05",
    ]
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None
    fitted = json.loads((out / RUN_FILE).read_text())
    profiles = {k: (v["profile"], v["usable"]) for k, v in fitted["providers"].items()}
    assert profiles == {
        "stripping": (None, False),  # whitespace stripped from content: nothing undoes it
        "exact_plain": ("exact", True),
        "vllm_spaced": ("vllm_spaced", True),
        "sglang_0514": ("sglang_0_5_14", True),
        "exact_whole": ("exact", True),
    }
    assert fitted["providers"]["sglang_0514"]["serving_overrides"] == ["serving=sglang_0_5_14"]
    # Pinned to the usable ones, in the order asked, no fallbacks.
    assert fitted["pinned"] == ["exact_plain", "vllm_spaced", "sglang_0514", "exact_whole"]
    answers = [r.body for r in srv.requests if not _is_probe(r.body)]
    assert len(answers) >= 4
    for body in answers:
        assert body["provider"]["only"] == [
            "exact_plain",
            "vllm_spaced",
            "sglang_0514",
            "exact_whole",
        ]
        assert body["provider"]["allow_fallbacks"] is False
    # Every probe is pinned to its provider.
    for req in srv.requests:
        if _is_probe(req.body):
            assert req.body["provider"]["order"] == [req.behaviour]
    # Records carry the fitted profile and where its evidence is; the answers came from
    # exact_plain (first in the pinned order): without logprobs, only the fitted profile
    # proves them (under `unknown` a reasoning ending in punctuation is unverifiable).
    records = read_jsonl(out / "records.jsonl")
    assert {r["provider"] for r in records} == {"exact_plain"}
    for rec in records:
        assert rec["serving_profile"] == "exact"
        assert rec["serving_probe"] == f"{RUN_FILE}#exact_plain"
        assert rec["ok"], rec["issues"]
        if rec["ok"]:
            emitted = truth["exact_plain"].emitted[rec["messages"][-1]["content"]]
            assert rec["output_ids"] == emitted  # proven means exact
    # Money: each battery within its cap, booked in the job's own journal, counted in
    # the job's spend (probes + answers = what the server billed).
    booked = _probe_intents(out)
    assert set(booked) == {INTENT_PREFIX + p for p in asked}
    for slug in asked:
        assert 0 < booked[INTENT_PREFIX + slug] <= 0.05
        _booked_as_billed(booked[INTENT_PREFIX + slug], _probe_bills(srv, slug), out, slug)
    assert summary["spend_usd"] >= srv.total_cost() - 1e-9
    assert summary["spend_usd"] > summary["spend_usd_records"]


def _booked_as_billed(booked: float, billed: float, out: Path, slug: str) -> None:
    """Never below what was billed; equal unless an attempt failed (a failed attempt's cost
    is booked at its worst case when the provider cannot say)."""
    assert booked >= billed - 1e-9
    if not read_jsonl(out / "serving_auto" / slug / "attempt_errors.jsonl"):
        assert booked == pytest.approx(billed)


def test_cache_hit_spends_nothing_and_discovery_finds_the_route(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    """No provider named: the battery is bought once on the route as configured and the
    provider that answered is judged; a second job reads the cache and buys no probe."""
    srv, _ = stack_server
    first = tmp_path / "first"
    status, _ = run_inprocess(_overrides(srv, tmp_path, first, kimi_dir), first)
    assert status == 0
    fitted = json.loads((first / RUN_FILE).read_text())
    assert fitted["pinned"] == ["routed_exact"]
    assert fitted["providers"]["routed_exact"]["profile"] == "exact"
    probes_bought = sum(_is_probe(r.body) for r in srv.requests)
    assert probes_bought == len(BATTERY.probes)  # once, on the route: nothing re-bought
    _booked_as_billed(sum(_probe_intents(first).values()), _probe_bills(srv), first, "_route")
    assert _probe_bills(srv) > 0
    cached = list((tmp_path / "cache").glob("*.json"))
    assert len(cached) == 2  # the route's providers and the provider's verdict

    second = tmp_path / "second"
    before = len(srv.requests)
    status, summary = run_inprocess(_overrides(srv, tmp_path, second, kimi_dir), second)
    assert status == 0 and summary is not None
    assert not any(_is_probe(r.body) for r in srv.requests[before:])
    assert sum(_probe_intents(second).values()) == 0.0
    again = json.loads((second / RUN_FILE).read_text())["providers"]["routed_exact"]
    assert again["source"] == "cache" and again["usd"] == 0.0
    assert again["probed_at"] == fitted["providers"]["routed_exact"]["probed_at"]
    assert all(r["serving_profile"] == "exact" for r in read_jsonl(second / "records.jsonl"))

    # A lifetime of 0 days: the verdict is stale, the probes are bought again.
    third = tmp_path / "third"
    before = len(srv.requests)
    run_inprocess([*_overrides(srv, tmp_path, third, kimi_dir), "serving_auto.cache_days=0"], third)
    assert sum(_is_probe(r.body) for r in srv.requests[before:]) == len(BATTERY.probes)


def test_route_change_reprobes_and_records_say_which_profile(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    srv, truth = stack_server
    out = tmp_path / "run"
    overrides = [*_overrides(srv, tmp_path, out, kimi_dir), "provider.routing.only=[switching]"]
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None
    fitted = json.loads((out / RUN_FILE).read_text())["providers"]
    assert fitted["switching"]["profile"] == "exact"
    assert fitted["exact_plain"]["profile"] == "exact"  # probed when it showed up
    pinned_probes = [r for r in srv.requests if _is_probe(r.body) and r.behaviour == "exact_plain"]
    assert len(pinned_probes) == len(BATTERY.probes)
    records = read_jsonl(out / "records.jsonl")
    assert len(records) == 4 and all(r["provider"] == "exact_plain" for r in records)
    # The answer that revealed the change was bought before the probe: nothing declared.
    assert records[0]["serving_profile"] == "unknown"
    assert records[0]["serving_probe"] == "not probed: exact_plain"
    assert not records[0]["ok"]
    for rec in records[1:]:
        assert rec["serving_profile"] == "exact"
        if rec["ok"]:
            assert rec["output_ids"] == truth["exact_plain"].emitted[rec["messages"][-1]["content"]]
    assert all(r["ok"] for r in records[1:])
    # The re-probe is booked in the same journal, and the job re-pinned to both.
    assert set(_probe_intents(out)) == {INTENT_PREFIX + "switching", INTENT_PREFIX + "exact_plain"}
    last = [r.body for r in srv.requests if not _is_probe(r.body)][-1]
    assert last["provider"]["only"] == ["switching", "exact_plain"]
    assert summary["spend_usd"] >= srv.total_cost() - 1e-9


def test_an_inconclusive_route_is_refused_before_any_answer(
    stack_server: Any,
    kimi_dir: Path,
    tmp_path: Path,
    api_key_env: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    srv, _ = stack_server
    out = tmp_path / "run"
    base = _overrides(srv, tmp_path, out, kimi_dir)
    status, _ = run_inprocess([*base, "provider.routing.only=[stripping,dropped_think]"], out)
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: serving=auto: no provider of the route")
    assert "stripping: quirks that cannot be inverted: content_whitespace_stripped" in err[-1]
    assert all(_is_probe(r.body) for r in srv.requests)  # no answer bought
    assert not (out / "records.jsonl").exists() or not read_jsonl(out / "records.jsonl")

    # No battery for the model: refused before anything is sent.
    before = len(srv.requests)
    other = tmp_path / "nobattery"
    status, _ = run_inprocess(
        [
            *_overrides(srv, tmp_path, other, kimi_dir),
            f"serving_auto.battery={tmp_path / 'none.yaml'}",
        ],
        other,
    )
    assert status == 2 and len(srv.requests) == before
    assert "name a profile: serving=NAME" in capsys.readouterr().err

    # Naming a profile buys anyway, without probes.
    named = tmp_path / "named"
    status, _ = run_inprocess(
        [
            *_overrides(srv, tmp_path, named, kimi_dir),
            "provider.routing.only=[stripping]",
            "serving=unknown",
        ],
        named,
    )
    assert status == 0
    assert not any(_is_probe(r.body) for r in srv.requests[before:])
    records = read_jsonl(named / "records.jsonl")
    assert records and all(r["serving_profile"] == "unknown" for r in records)
    assert all(r["serving_probe"] == "serving=unknown" for r in records)


def test_reconstruct_uses_the_recorded_profile_unless_one_is_named(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    from kimi_pipe.core.models import load_model
    from kimi_pipe.stages.reconstruct import run_configured

    srv, _ = stack_server
    out = tmp_path / "run"
    status, _ = run_inprocess(
        [*_overrides(srv, tmp_path, out, kimi_dir), "provider.routing.only=[exact_plain]"], out
    )
    assert status == 0
    inline = {r["id"]: r for r in read_jsonl(out / "records.jsonl")}
    common = [f"model.tokenizer.path={kimi_dir}"]
    model = load_model(compose(common).model)
    target = tmp_path / "auto.jsonl"
    run_configured(compose(common), model, out / "records.jsonl", target)  # serving=auto
    for rec in read_jsonl(target):
        assert rec["serving_profile"] == "exact"
        assert (rec["ok"], rec["output_ids"]) == (
            inline[rec["id"]]["ok"],
            inline[rec["id"]]["output_ids"],
        )
    assert all(r["ok"] for r in read_jsonl(target))
    named = tmp_path / "named.jsonl"
    run_configured(compose([*common, "serving=unknown"]), model, out / "records.jsonl", named)
    flagged = read_jsonl(named)
    assert not any(r["ok"] for r in flagged)  # nothing declared: the tails are unverifiable
    assert all("reasoning_tail_unverifiable" in r["issues"] for r in flagged)


def test_a_fitted_spec_is_what_the_command_line_composes() -> None:
    spec = "vllm_spaced+tool_call_ids=foreign"
    profile = profile_from_spec(spec)
    composed = serving_profile(compose(spec_overrides(spec)))
    assert spec_overrides(spec) == ["serving=vllm_spaced", "serving.tool_call_ids=foreign"]
    assert {k: getattr(profile, k) for k in CHOICES} == {k: getattr(composed, k) for k in CHOICES}
    assert profile.tool_call_ids == "foreign" and profile.marker_spacing == "spaces"


def test_the_local_provider_declares_its_profile(tmp_path: Path) -> None:
    from kimi_pipe.stages.jobs.generate import generate_job

    job = generate_job(compose(["provider=local", "model=smollm2"]), tmp_path)
    assert job.serving.name == "auto"  # the default
    route, pin = prepare(job.auto_target(), tmp_path)
    assert route.declared == "unknown" and route.declared_by == "provider.serving_profile"
    assert job.pinned(pin).serving.name == "unknown"
    assert not (tmp_path / RUN_FILE).exists()  # nothing probed, nothing bought


USD = r"\$(\d+\.\d+)"


def test_probes_that_do_not_fit_the_budget_say_so_with_their_worst_case(
    fake_openrouter: Any, kimi_dir: Path, tmp_path: Path
) -> None:
    """Issue 30: budget.usd below what the budget holds for one probe used to end in "no
    provider answered". The command line says that the probes did not fit, the amounts
    compared (each as the budget held it, against what it left) and what to change."""
    import re

    from tests.support.conftest_generate import run_subprocess

    srv = fake_openrouter()
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 2)
    out = tmp_path / "run"
    overrides = [
        o for o in base_overrides(prompts, srv.url(), out, kimi_dir) if o not in SERVING_AS_IS
    ]
    done = run_subprocess(
        [*overrides, "budget.usd=0.01", f"serving_auto.cache_dir={tmp_path / 'cache'}"]
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "--- Logging error ---" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: serving=auto: the probes did not "), (
        done.stderr[-2000:]
    )
    line = lines[0]
    assert "no provider answered" not in line
    assert srv.requests == []  # not a probe bought, not an answer
    # What one probe is held at (x budget.overbill_guard, 3 by default) against what the
    # budget left for the probes: the first exceeds the second, as said.
    found = re.search(
        rf"the cheapest, held at 3\.00x \(budget\.overbill_guard\), needs {USD}, more than "
        rf"the {USD} left of budget\.usd=0\.01",
        line,
    )
    assert found, line
    held, left = float(found[1]), float(found[2])
    assert left == 0.01 and held > left
    # Its worst case is at least max_tokens of the battery at the listed output price.
    listed_out = 2.5e-6  # fake_openrouter's default USD per completion token
    assert held >= 3 * BATTERY.max_tokens * listed_out
    total = re.search(rf"{len(BATTERY.probes)} probes not bought \(worst case {USD} in all\)", line)
    assert total and float(total[1]) * 3 >= held  # the battery's worst case, unheld
    # What to change: a budget that holds one probe, or a profile named (no probes).
    need = re.search(rf"raise budget\.usd to at least {USD}", line)
    assert need and float(need[1]) >= held
    assert "serving=NAME" in line

    # Raised as said, the probes are bought and the job runs (the fake changes nothing).
    again = run_subprocess(
        [
            *overrides,
            f"budget.usd={float(need[1]) * 4}",
            f"serving_auto.cache_dir={tmp_path / 'c2'}",
        ]
    )
    assert "the probes did not fit" not in again.stderr
    assert sum(_is_probe(r.body) for r in srv.requests) == len(BATTERY.probes)


def test_two_datasets_buy_the_probes_once_and_count_them_against_the_jobs_cap(
    stack_server: Any, kimi_dir: Path, tmp_path: Path, api_key_env: str
) -> None:
    """datasets=[a,b] under serving=auto: the first dataset's run buys the battery (booked in
    its own journal), the second reads the verdict from the cache and buys none, and the
    job's spend (probes included) is what the server billed, under the cap."""
    srv, _ = stack_server
    out = tmp_path / "job"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_prompts(a, 2, prefix="a")
    write_prompts(b, 2, prefix="b")
    overrides = [
        *_overrides(srv, tmp_path, out, kimi_dir, usd=1.0),
        f"datasets=[{{name: a, path: '{a}'}},{{name: b, path: '{b}'}}]",
    ]
    status, summary = run_inprocess(overrides, out)
    assert status == 0 and summary is not None
    probes = [r for r in srv.requests if _is_probe(r.body)]
    assert len(probes) == len(BATTERY.probes)  # one battery for the whole job
    first = json.loads((out / "a" / RUN_FILE).read_text())["providers"]["routed_exact"]
    second = json.loads((out / "b" / RUN_FILE).read_text())["providers"]["routed_exact"]
    assert first["source"] != "cache" and first["usd"] > 0
    assert second["source"] == "cache" and second["usd"] == 0.0
    assert sum(_probe_intents(out / "a").values()) >= _probe_bills(srv) - 1e-9
    assert sum(_probe_intents(out / "b").values()) == 0.0
    for name in ("a", "b"):
        records = read_jsonl(out / name / "records.jsonl")
        assert len(records) == 2 and all(r["serving_profile"] == "exact" for r in records)
    assert srv.total_cost() - 1e-9 <= summary["spend_usd"] <= 1.0
