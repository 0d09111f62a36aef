"""Real providers' recorded answers (tests/fixtures/wild, provenance per row: docs/wild.md).

Kimi K2.5 answers recorded from OpenRouter providers and two direct APIs in public client
libraries' test cassettes and one app's LLM test recorder, and other Kimi models' answers
(and a plan alias's) from the same recordings. Through
the one reconstruction entry under the default profile: the behaviours the recordings show
are read as what they are (the model writing `<think>`, history reasoning sent back as
`reasoning_details`, history ids re-rendered), no other model's answer is ever `ok`, and every
record that reaches training has the prompt ids its provider billed.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.core import candidates
from kimi_pipe.core.models import Model
from kimi_pipe.core.record_builder import RecordBuilder
from kimi_pipe.extraction.resolve import resolvable
from kimi_pipe.extraction.resolve_settings import ResolveSettings
from tests.support.candidate_sets import sequences_of
from tests.support.cases import FIXTURES
from tests.support.server_shapes import shipped_profile
from tools.cassette2corpus import mismatches

WILD = FIXTURES / "wild"
THINK = "<think>"
MAX_OPTIONS = ResolveSettings().max_options


def read(name: str) -> list[dict[str, Any]]:
    path = WILD / name
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else None
    text = text if text is not None else path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def build(builder: RecordBuilder, row: dict[str, Any]) -> dict[str, Any]:
    request = row["request"]
    return dict(builder.build(request["messages"], request.get("tools"), row["response"], request))


@pytest.fixture(scope="module")
def wild(kimi: Model) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    builder = RecordBuilder(kimi)
    return [(row, build(builder, row)) for row in read("kimi_k25_wild.jsonl")]


def reaches_training(record: dict[str, Any]) -> bool:
    """Proven, or taken by extraction's target resolution (a closed or bounded set it scores by
    default, nothing else blocking)."""
    return bool(record["ok"] or resolvable(record, max_options=MAX_OPTIONS) is None)


@pytest.mark.kimi
def test_every_row_has_provenance() -> None:
    for name in ("kimi_k25_wild.jsonl", "other_kimi_wild.jsonl.gz"):
        for row in read(name):
            source = row["source"]
            assert source["repo"] and source["path"] and len(source["commit"]) == 40, row["id"]
            assert source["url"].startswith("https://github.com/" + source["repo"]), row["id"]


@pytest.mark.parametrize("name", ["kimi_k25_wild.jsonl", "other_kimi_wild.jsonl.gz"])
def test_every_streamed_answer_is_what_its_recorded_stream_adds_up_to(name: str) -> None:
    """A streamed row's `response` (what reconstruction reads) is its `raw_stream` (the SSE
    payloads as recorded) assembled, so no assembled answer differs from what was sent."""
    rows = read(name)
    streamed = [r for r in rows if r.get("raw_stream")]
    assert len(streamed) >= 18
    assert mismatches(rows) == []
    # The check sees a change: one delta's text edited after assembly.
    row = json.loads(json.dumps(streamed[0]))
    message = row["response"]["choices"][0]["message"]
    field = "content" if message.get("content") else "reasoning_content"
    message[field] = (message.get(field) or "") + " "
    assert mismatches([row]) == [row["id"]]


@pytest.mark.kimi
def test_records_that_reach_training_have_the_billed_prompt(wild: list) -> None:
    """The prompt held to the output's standard: every record that reaches training (proven,
    or a closed or bounded set the target resolves) has exactly as many prompt ids as were
    billed."""
    reached = 0
    for row, record in wild:
        if reaches_training(record):
            reached += 1
            assert len(record["prompt_ids"]) == row["response"]["usage"]["prompt_tokens"], row["id"]
    # Measured (docs/wild.md): 21 of 29 taken by extraction; before the prompt proof 10 of 27
    # counted this way.
    assert reached >= 21


@pytest.mark.kimi
def test_closed_sets_fit_what_the_target_scores(
    wild: list, kimi: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed set listing more whole options than extraction's target scores by default
    (resolve.max_options) is never resolved: where an argument's edges multiply a tail's
    readings, they become choice points, standing for the same sequences in fewer options."""
    assert candidates.MAX_LISTED_OPTIONS == MAX_OPTIONS
    factored = [
        (row, record)
        for row, record in wild
        if record.get("candidates", {}).get("closed")
        and any(o.get("points") for o in record["candidates"]["options"])
        and len(row["response"]["choices"][0]["message"]["tool_calls"]) == 1
    ]
    # Chutes' two one-call answers with marker spaces (2 spacings x 8 tails x 6 edges listed),
    # and AtlasCloud's (5 missing markers x 8 tails x 6 edges).
    assert sorted(row["provider"] for row, _ in factored) == ["AtlasCloud"] * 2 + ["Chutes"] * 2
    for _, record in wild:
        if record.get("candidates", {}).get("closed"):
            assert len(record["candidates"]["options"]) <= MAX_OPTIONS
    monkeypatch.setattr(candidates, "MAX_LISTED_OPTIONS", 10**6)
    listing = RecordBuilder(kimi)
    for row, record in factored:
        listed = build(listing, row)["candidates"]
        assert len(listed["options"]) > MAX_OPTIONS
        assert not any(o.get("points") for o in listed["options"])
        assert sequences_of(listed["options"]) == sequences_of(record["candidates"]["options"])
        assert resolvable(record, max_options=MAX_OPTIONS) is None


@pytest.mark.kimi
def test_the_open_sets_of_two_calls_are_bounded_by_their_gaps(
    wild: list, kimi: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AtlasCloud's and Chutes' answers to one request (two calls, `{"a": 2, "b": 3}`): a
    coerced compact reading is short of the bill, so the stack may have dropped whitespace
    anywhere after the reasoning's last lone space. Every such reading is a gap (core/gaps.py)
    and the set goes to the target with them. The coercion spellings of the returned count
    ride on each call's choice point: the same sequences as when each was an option."""
    both = {row["provider"]: (row, r) for row, r in wild if row["id"] == "7b93cdc983"}
    assert set(both) == {"AtlasCloud", "Chutes"}
    split = candidates._coercion_assignments  # every spelling an option of its own
    for provider, (row, record) in both.items():
        cands = record["candidates"]
        billed = record["completion_tokens_reported"]
        assert cands["closed"] is False and cands["gaps"], provider
        assert resolvable(record, max_options=MAX_OPTIONS) is None, provider
        assert all(len(ids) == billed for ids in sequences_of(cands["options"]))
        assert all(len(g["output_ids"]) < billed for g in cands["gaps"])
        assert all(0 < g["start"] < len(g["output_ids"]) for g in cands["gaps"])
        monkeypatch.setattr(candidates, "MAX_LISTED_OPTIONS", 10**6)
        monkeypatch.setattr(
            candidates, "_coercion_assignments", lambda a, t, merge_with=None: split(a, t)
        )
        apart = build(RecordBuilder(kimi), row)["candidates"]
        monkeypatch.undo()
        assert len(apart["options"]) > MAX_OPTIONS >= len(cands["options"]), provider
        assert sequences_of(apart["options"]) == sequences_of(cands["options"]), provider


@pytest.mark.kimi
def test_the_report_counts_what_extraction_takes(wild: list, tmp_path: Path) -> None:
    """The report's resolvable tokens (the routing by exact tokens per dollar) are the records
    extraction's target resolution takes: not a closed set beside another error (an answer
    check added after reconstruction), nor one over the run's `resolve.max_options`."""
    from kimi_pipe.core.record_builder import mark_flagged
    from kimi_pipe.reporting.runs import Run
    from kimi_pipe.reporting.stats import run_yield

    # Records with a proven prefix are counted as prefix tokens, not here (core/token_yield.py).
    taken = [r for _, r in wild if reaches_training(r) and r["evidence"] == "unresolved"]
    assert len(taken) == 13  # the two bounded open sets (core/gaps.py) among them
    bought = sum(r["completion_tokens_reported"] for r in taken)

    def resolvable_tokens(records: list[dict[str, Any]], config: dict[str, Any]) -> int:
        run = Run(name="r", path=tmp_path, records=records, config=config, summary={})
        return int(run_yield(run)["resolvable_tokens"])

    assert resolvable_tokens(taken, {}) == bought
    flagged = [dict(mark_flagged(copy.deepcopy(r), ["other_provider"])) for r in taken]
    assert resolvable_tokens(flagged, {}) == 0
    largest = max(len(r["candidates"]["options"]) for r in taken)
    assert resolvable_tokens(taken, {"resolve": {"max_options": largest}}) == bought
    assert resolvable_tokens(taken, {"resolve": {"max_options": 1}}) == 0


@pytest.mark.kimi
def test_think_written_by_the_model_moves_the_boundary(wild: list, kimi: Model) -> None:
    """Moonshot AI's and AtlasCloud's bills: prompt one id short of the rendering, completion
    one over the reading. The model wrote `<think>`: it starts the output, and the loss mask
    starts after the prompt the model was given."""
    think = kimi.markers[THINK]
    moved = [(row, r) for row, r in wild if "think_open_billed_as_output" in r["issues"]]
    assert {row["provider"] for row, _ in moved} >= {"AtlasCloud", "Moonshot AI"}
    for row, record in moved:
        usage = row["response"]["usage"]
        if "billing_mismatch" in record["issues"]:
            # AtlasCloud's 128/130: the prompt's bill alone places the boundary, and the
            # output with `<think>` is one over its own bill. Flagged, never trained on.
            assert not reaches_training(record), row["id"]
            continue
        assert record["output_ids"][0] == think and record["prompt_ids"][-1] != think
        assert len(record["output_ids"]) == usage["completion_tokens"], row["id"]
        mask = record["loss_mask"]
        assert mask[: len(record["prompt_ids"])] == [0] * len(record["prompt_ids"])
        assert mask[len(record["prompt_ids"])] == 1


@pytest.mark.parametrize("serving", ["unknown", "exact", "moonshot"])
@pytest.mark.kimi
def test_a_tool_turn_one_marker_short_lists_every_missing_marker(kimi: Model, serving: str) -> None:
    """AtlasCloud bills each of its four recorded tool-call turns one id under the reading
    with the `<think>` the model wrote (its six other turns fit it). The answer with content
    cannot hold its tool section inside its reasoning (a parser's reasoning ends at the section,
    and text after the section is dropped), so that reading alone does not explain the bills:
    each turn lists every marker a parser does not need, one missing at a time, and is never
    `ok`, under any profile; the target chooses."""
    builder = RecordBuilder(kimi, serving=shipped_profile(serving))
    names = ["<think>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>"]
    marker_ids = {kimi.markers[name] for name in [*names, "</think>"]}
    turns = [
        row
        for row in read("kimi_k25_wild.jsonl")
        if row["provider"] == "AtlasCloud"
        and row["response"]["choices"][0]["finish_reason"] == "tool_calls"
    ]
    assert len(turns) == 4
    for row in turns:
        record = build(builder, row)
        assert not record["ok"] and "tool_turn_marker_missing" in record["issues"], row["id"]
        assert reaches_training(record), (row["id"], serving)
        if not record["candidates"]["closed"]:  # the coerced one under `unknown`: bounded
            assert "dropped whitespace" in record["candidates"]["why_open"], row["id"]
            assert record["candidates"]["gaps"], row["id"]
        usage = row["response"]["usage"]
        assert len(record["prompt_ids"]) == usage["prompt_tokens"]
        options = record["candidates"]["options"]
        assert all(len(o["output_ids"]) == usage["completion_tokens"] for o in options)
        # The full reading (one over the bill), less exactly one marker id.
        full = [kimi.markers["<think>"], *record["output_ids"][1:], kimi.markers["<|im_end|>"]]
        missing = set()
        for option in options:
            if "restored" in option["label"] or "written '" in option["label"]:
                continue  # another tail or typing of the arguments: not the record's own text
            ids = option["output_ids"]
            pairs = enumerate(zip(ids, full[:-1], strict=True))
            cut = next((i for i, (a, b) in pairs if a != b), len(ids))
            assert ids == full[:cut] + full[cut + 1 :] and full[cut] in marker_ids, option["label"]
            missing.add(kimi.tokenizer.piece(full[cut]))
        content = row["response"]["choices"][0]["message"].get("content")
        assert missing == set(names) | (set() if content else {"</think>"}), (row["id"], missing)


@pytest.mark.kimi
def test_one_id_short_beside_a_prompt_that_holds_think_is_a_mismatch(kimi: Model) -> None:
    """The missing-marker readings are weighed only beside a stack that left `<think>` to the
    model (the one recorded billing a tool-call turn one id short): Chutes' tool-call turns,
    whose prompts hold `<think>`, billed one id less, are `billing_mismatch`, nothing listed."""
    builder = RecordBuilder(kimi)
    turns = [
        row
        for row in read("kimi_k25_wild.jsonl")
        if row["provider"] == "Chutes"
        and row["response"]["choices"][0]["finish_reason"] == "tool_calls"
    ]
    assert turns
    for row in turns:
        short = copy.deepcopy(row)
        short["response"]["usage"]["completion_tokens"] -= 1
        record = build(builder, short)
        assert "tool_turn_marker_missing" not in record["issues"], row["id"]
        assert "billing_mismatch" in record["issues"] and not reaches_training(record), row["id"]


def as_one_text(row: dict[str, Any], *, spaced: bool) -> dict[str, Any]:
    """The row's answer as a stack with no reasoning parser sends it: `<think>`, the reasoning,
    `</think>` and the content in one text (`spaced`: with vLLM's space beside each marker).
    The same ids, so the same bills."""
    response = copy.deepcopy(row["response"])
    message = response["choices"][0]["message"]
    gap = " " if spaced else ""
    reasoning = message.pop("reasoning")
    message.pop("reasoning_details", None)
    message["content"] = f"{THINK}{gap}{reasoning}{gap}</think>{gap}{message['content']}"
    return {**row, "response": response}


def holds(record: dict[str, Any], ids: list[int]) -> bool:
    """The record's ids are `ids`, or `ids` is a sequence its candidate set stands for."""
    options = (record.get("candidates") or {}).get("options") or []
    return record["output_ids"] == ids or tuple(ids) in sequences_of(options)


@pytest.mark.kimi
def test_think_as_text_is_read_as_the_marker(wild: list, kimi: Model) -> None:
    """Moonshot AI's answer (the model wrote `<think>`: prompt billed one id short, completion
    one over) as a stack with no reasoning parser sends it, bare and with marker spaces: the
    recorded ids and prompt, reaching training under `unknown`, the note `think_open_as_text`.
    Before, `<think>` stayed three ids of characters and the prompt was `prompt_unproven`."""
    unknown = RecordBuilder(kimi)
    exact = RecordBuilder(kimi, shipped_profile("exact"))
    rows = [(row, r) for row, r in wild if row["provider"] == "Moonshot AI"]
    assert rows
    for row, recorded in rows:
        for spaced in (False, True):
            record = build(unknown, as_one_text(row, spaced=spaced))
            assert "think_open_as_text" in record["issues"], (row["id"], spaced)
            assert record["prompt_ids"] == recorded["prompt_ids"]
            assert reaches_training(record) and holds(record, recorded["output_ids"])
        bare = build(exact, as_one_text(row, spaced=False))
        assert bare["ok"] and bare["output_ids"][0] == kimi.markers[THINK]
        assert bare["output_ids"] == build(exact, row)["output_ids"]


@pytest.mark.kimi
def test_think_as_text_in_an_answer_cut_inside_its_reasoning(wild: list, kimi: Model) -> None:
    """Moonshot AI's answer cut by max_tokens inside its reasoning, from a stack with no
    reasoning parser: the content is `<think>` and the reasoning's head, no `</think>`. Billed
    for the marker and the head's ids: proven, the output starting with the marker."""
    builder = RecordBuilder(kimi, shipped_profile("exact"))
    rows = [row for row, _ in wild if row["provider"] == "Moonshot AI"]
    assert rows
    for row in rows:
        cut = copy.deepcopy(row)
        choice = cut["response"]["choices"][0]
        head = choice["message"].pop("reasoning")[:60]
        choice["message"].pop("reasoning_details", None)
        choice["message"]["content"] = THINK + head
        choice["finish_reason"] = "length"
        choice.pop("native_finish_reason", None)
        truth = [kimi.markers[THINK], *kimi.tokenizer.encode_ordinary(head)]
        cut["response"]["usage"]["completion_tokens"] = len(truth)
        record = build(builder, cut)
        assert record["ok"] and record["output_ids"] == truth, record["issues"]
        assert {"truncated", "think_open_as_text"} <= set(record["issues"])


@pytest.mark.kimi
def test_marker_spaces_beside_think_billed_as_output(wild: list, kimi: Model) -> None:
    """Moonshot AI's answer with the space vLLM's streaming leaves after each marker (` R`,
    ` C`): the output as read misses its bill. Before, the prompt (billed one short) was then
    `prompt_unproven` and the record lost; now the prompt's bill alone places `<think>` in the
    output, and each candidate reading weighs both bills: the recorded ids are among them."""
    builder = RecordBuilder(kimi)
    rows = [(row, r) for row, r in wild if row["provider"] == "Moonshot AI"]
    assert rows
    for row, recorded in rows:
        spaced = copy.deepcopy(row)
        message = spaced["response"]["choices"][0]["message"]
        message["reasoning"], message["content"] = (
            " " + message["reasoning"],
            " " + message["content"],
        )
        message.pop("reasoning_details", None)
        record = build(builder, spaced)
        assert "prompt_unproven" not in record["issues"]
        assert record["prompt_ids"] == recorded["prompt_ids"]
        assert reaches_training(record) and holds(record, recorded["output_ids"])


@pytest.mark.kimi
def test_think_as_text_beside_a_prompt_that_holds_it(kimi: Model) -> None:
    """Chutes' and ModelRun's answers, billed with `<think>` in the prompt and `ok` under
    `exact`, their reasoning sent with `<think>` in front (a stack that echoes the prompt's
    end): the ids as recorded, the marker left in the prompt. A model that wrote those
    characters itself would have been billed for them: that bill reaches no training."""
    builder = RecordBuilder(kimi, shipped_profile("exact"))
    checked = 0
    for row in read("kimi_k25_wild.jsonl"):
        message = row["response"]["choices"][0]["message"]
        if row["provider"] not in ("Chutes", "ModelRun") or not message.get("reasoning"):
            continue
        recorded = build(builder, row)
        if not recorded["ok"]:
            continue
        echoed = copy.deepcopy(row)
        echoed_message = echoed["response"]["choices"][0]["message"]
        echoed_message["reasoning"] = THINK + echoed_message["reasoning"]
        echoed_message.pop("reasoning_details", None)
        record = build(builder, echoed)
        assert record["ok"] and "think_open_as_text" in record["issues"], row["id"]
        assert "think_open_billed_as_output" not in record["issues"]
        assert (record["prompt_ids"], record["output_ids"]) == (
            recorded["prompt_ids"],
            recorded["output_ids"],
        )
        assert record["prompt_ids"][-1] == kimi.markers[THINK]
        # The characters as the model's own text: what they cost over the marker's reading.
        text = message["reasoning"]
        extra = len(kimi.tokenizer.encode_ordinary(THINK + text)) - len(
            kimi.tokenizer.encode_ordinary(text)
        )
        echoed["response"]["usage"]["completion_tokens"] += extra
        literal = build(builder, echoed)
        assert not literal["ok"] and not reaches_training(literal), row["id"]
        checked += 1
    assert checked >= 4


@pytest.mark.kimi
def test_history_sent_back_as_reasoning_details_is_read(wild: list) -> None:
    """AtlasCloud's second turns: OpenRouter's `reasoning_details` in the history reached the
    model (the bill is 39-90 ids over the template's reading of `reasoning_content` alone), and
    the earlier `add:0` ids were re-rendered as `functions.add:0`."""
    second = [
        (row, r)
        for row, r in wild
        if row["provider"] == "AtlasCloud" and len(row["request"]["messages"]) > 2
    ]
    assert second
    for row, record in second:
        assert "prompt_history_rerendered" in record["issues"], row["id"]
        assert "prompt_unproven" not in record["issues"]


@pytest.mark.kimi
@pytest.mark.parametrize("serving", ["unknown", "exact"])
def test_without_a_billed_prompt_a_history_that_renders_several_ways_is_flagged(
    kimi: Model, serving: str
) -> None:
    """The recorded second turns with `usage.prompt_tokens` removed (as a stack that omits it,
    or sends it as text): their history renders several ways (AtlasCloud's stack rendered 39-90
    ids more than the template's reading), and nothing billed says which. Before the code,
    Chutes' four reached training, one with 195 prompt ids where 201 were billed. Now each is
    `prompt_not_billed`, never `ok` and never resolvable; a first turn (one reading) is not."""
    builder = RecordBuilder(kimi, shipped_profile(serving))
    flagged = first_turns = 0
    for row in read("kimi_k25_wild.jsonl"):
        for prompt_tokens in ("absent", str(row["response"]["usage"]["prompt_tokens"])):
            response = copy.deepcopy(row["response"])
            if prompt_tokens == "absent":
                del response["usage"]["prompt_tokens"]
            else:
                response["usage"]["prompt_tokens"] = prompt_tokens
            record = build(builder, {**row, "response": response})
            if len(row["request"]["messages"]) > 2:
                flagged += 1
                assert "prompt_not_billed" in record["issues"], row["id"]
                assert not record["ok"] and resolvable(record) is not None, row["id"]
            else:
                first_turns += 1
                assert "prompt_not_billed" not in record["issues"], row["id"]
    assert flagged >= 24 and first_turns >= 34  # 12 second turns and 17 first, two ways each


@pytest.mark.kimi
def test_unexplained_billing_never_reaches_training(wild: list) -> None:
    """The direct API whose bills fit no reading (prompt 7-29 ids over every rendering):
    every answer flagged, none trained on."""
    avian = [(row, r) for row, r in wild if row["provider"] == "api.avian.io"]
    assert len(avian) == 7
    for row, record in avian:
        assert not reaches_training(record), row["id"]
    assert sum("prompt_unproven" in r["issues"] for _, r in avian) >= 6


@pytest.mark.kimi
@pytest.mark.parametrize("serving", ["unknown", "exact", "moonshot"])
def test_no_other_model_is_ever_ok(kimi: Model, serving: str) -> None:
    """Kimi K2-0905, K2-Instruct and K2.6 answers, and Kimi Code's `kimi-for-coding` alias
    (356 recorded): `other_model`, never `ok`, whatever the profile declares."""
    builder = RecordBuilder(kimi, shipped_profile(serving))
    other = read("other_kimi_wild.jsonl.gz")
    assert len(other) == 356
    for row in other:
        record = build(builder, row)
        assert not record["ok"] and "other_model" in record["issues"], row["id"]


@pytest.mark.kimi
def test_an_alias_whose_ids_fit_both_bills_is_still_another_model(kimi: Model) -> None:
    """Kimi Code (api.kimi.com/coding, talkcody's recording) asked for `kimi-k2.5` answers as
    `kimi-for-coding`, a plan alias. One answer's prompt and completion both fit K2.5's
    readings id for id (`<think>` billed as output), so the bills alone would take it: the
    served name is what keeps it out. Same tokenizer, same bills, a model the name does not
    prove."""
    row = next(r for r in read("other_kimi_wild.jsonl.gz") if r["id"] == "c5ef80f3a4")
    assert row["response"]["model"] == "kimi-for-coding"
    usage = row["response"]["usage"]
    record = build(RecordBuilder(kimi, shipped_profile("exact")), row)
    assert len(record["prompt_ids"]) == usage["prompt_tokens"]
    assert record["completion_tokens_reconstructed"] == usage["completion_tokens"]
    assert not record["ok"]
    assert record["issues"] == ["other_model", "think_open_billed_as_output"]


@pytest.mark.kimi
@pytest.mark.parametrize("serving", ["unknown", "exact", "moonshot"])
def test_a_direct_api_whose_bills_fit_no_reading_is_lost(kimi: Model, serving: str) -> None:
    """Alibaba Cloud's coding plan (DashScope) answering as `kimi-k2.5` after 128 turns: the
    billed prompt is 4,113-4,257 ids under every reading (65,621 against 69,734-69,878) and the
    completion one id under the reading. Flagged under every profile, never trained on."""
    row = next(r for r in read("kimi_k25_wild.jsonl") if r["id"] == "d0662e9bc0")
    assert row["provider"] == "coding.dashscope.aliyuncs.com"
    record = build(RecordBuilder(kimi, shipped_profile(serving)), row)
    assert {"prompt_unproven", "billing_mismatch"} <= set(record["issues"])
    assert not reaches_training(record)


def test_corpus_files_are_where_docs_say() -> None:
    assert (Path(__file__).parent.parent / "docs" / "wild.md").is_file()


def test_an_answer_from_outside_the_pinned_route_is_flagged() -> None:
    """OpenRouter falls back to another provider unless told not to: an answer from outside
    `provider.routing.only` comes from a stack the job was not pinned to (`other_provider`)."""
    from kimi_pipe.core.answer_checks import answer_issues

    row = read("kimi_k25_wild.jsonl")[0]
    response = {**row["response"], "provider": "AtlasCloud", "model": "moonshotai/kimi-k2.5"}
    pinned = {"extra_body": {"provider": {"only": ["atlas-cloud"]}}}
    elsewhere = {"extra_body": {"provider": {"only": ["chutes", "deepinfra/fp4"]}}}
    assert "other_provider" not in answer_issues(
        response, "openrouter/moonshotai/kimi-k2.5", pinned
    )
    assert "other_provider" in answer_issues(response, "openrouter/moonshotai/kimi-k2.5", elsewhere)
    assert "other_provider" not in answer_issues(response, "openrouter/moonshotai/kimi-k2.5", None)
