"""Prompt datasets: local JSONL and Hugging Face row mappings over real `datasets` IO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kimi_pipe.store.prompt_datasets import Prompt, PromptSet, load_prompts

ROOT = Path(__file__).resolve().parents[1]
DATASET_DIR = ROOT / "conf" / "dataset"


def jsonl_cfg(path: Path | str, **extra: object):
    cfg = OmegaConf.load(DATASET_DIR / "jsonl.yaml")
    cfg.path = str(path)
    for key, value in extra.items():
        cfg[key] = value
    return cfg


def write_lines(path: Path, lines: list[object]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line if isinstance(line, str) else json.dumps(line, ensure_ascii=False))
            handle.write("\n")
    return path


USER = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "4"}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


# --- jsonl ---------------------------------------------------------------------------


def test_jsonl_reads_records_in_file_order(tmp_path: Path) -> None:
    tool_turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "call the tool",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            {"id": "b", "messages": [USER]},
            {"id": "a", "messages": tool_turns, "tools": [WEATHER_TOOL]},
            {"id": 7, "messages": [{"role": "user", "content": "naïve ünïcode 你好"}]},
        ],
    )
    prompts = load_prompts(jsonl_cfg(path))
    assert isinstance(prompts, PromptSet)
    got = list(prompts)
    assert [p.id for p in got] == ["b", "a", "7"]
    assert got[0] == Prompt("b", [USER], None)
    assert got[1].messages == tool_turns
    assert got[1].tools == [WEATHER_TOOL]
    assert got[2].messages[0]["content"] == "naïve ünïcode 你好"
    assert len(prompts) == 3
    assert prompts.skipped == {}
    # A second pass gives the same prompts (deterministic, re-iterable).
    assert list(prompts) == got


def test_jsonl_bad_rows_are_counted_not_fatal(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            {"id": "ok1", "messages": [USER]},
            "{not json",
            ["a", "list"],
            {"id": "nomsg"},
            {"id": "empty", "messages": []},
            {"id": "badrole", "messages": [{"role": "wizard", "content": "x"}]},
            {"id": "badcontent", "messages": [{"role": "user", "content": 5}]},
            {"id": "image", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            {"id": "badtools", "messages": [USER], "tools": [{"name": "x"}]},
            {"id": "ok1", "messages": [USER]},
            {"id": "sys_only", "messages": [{"role": "system", "content": "s"}]},
            "",
            {"messages": [USER, ANSWER]},
            '{"id": "torn", "messages": [{"role": "us',
        ],
    )
    prompts = load_prompts(jsonl_cfg(path))
    got = list(prompts)
    # Line 13 had no id: it gets a stable line-based one; its trailing answer is dropped.
    assert [(p.id, p.messages) for p in got] == [("ok1", [USER]), ("line-13", [USER])]
    assert prompts.skipped == {
        "invalid_json": 2,
        "not_an_object": 1,
        "missing_messages": 1,
        "invalid_messages": 1,
        "invalid_role": 1,
        "invalid_content": 1,
        "non_text_content": 1,
        "invalid_tools": 1,
        "duplicate_id": 1,
        "no_turn_to_answer": 1,
    }
    assert prompts.skipped_examples["invalid_json"] == ["line-2", "line-14"]
    summary = prompts.summary()
    assert summary["prompts"] == 2 and summary["skipped"] == dict(prompts.skipped)
    assert json.loads(json.dumps(summary)) == summary  # goes into summary.json as is
    # Counts are per pass, not accumulated over passes.
    list(prompts)
    assert prompts.skipped["invalid_json"] == 2


def test_jsonl_drop_trailing_assistant_switch(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"id": "x", "messages": [USER, ANSWER]}])
    assert [p.messages for p in load_prompts(jsonl_cfg(path))] == [[USER]]
    kept = load_prompts(jsonl_cfg(path, drop_trailing_assistant=False))
    assert list(kept) == []
    assert kept.skipped == {"no_turn_to_answer": 1}


def test_jsonl_text_parts_tools_string_and_limit(tmp_path: Path) -> None:
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            {"id": "1", "messages": [parts], "tools": json.dumps([WEATHER_TOOL])},
            {"id": "2", "messages": [USER], "tools": []},
            {"id": "3", "messages": [USER]},
        ],
    )
    got = list(load_prompts(jsonl_cfg(path)))
    assert got[0].messages == [{"role": "user", "content": "ab"}]
    assert got[0].tools == [WEATHER_TOOL]
    assert got[1].tools is None
    limited = load_prompts(jsonl_cfg(path, limit=2))
    assert [p.id for p in limited] == ["1", "2"]
    assert len(limited) == 2


def test_jsonl_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(jsonl_cfg(missing))


def test_jsonl_path_is_required() -> None:
    cfg = OmegaConf.load(DATASET_DIR / "jsonl.yaml")
    with pytest.raises(ValueError, match=r"dataset\.path"):
        load_prompts(cfg)


# --- Hugging Face datasets: real `datasets` IO over local files ------------------------
# The Hub is not reachable here, so each B-config is pointed (hf_id) at a local folder laid
# out like a Hub dataset repo (README.md `configs:` + data/<split>-*.parquet) whose rows
# follow the real dataset's schema. The same `load_dataset(hf_id, hf_config, split=...)`
# call, Arrow/Parquet round trip and row mapping run as with the real Hub.


def hub_repo(root: Path, rows: list[dict], split: str = "train", config: str = "default") -> Path:
    from datasets import Dataset

    (root / "data").mkdir(parents=True)
    Dataset.from_list(rows).to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        f"- config_name: {config}\n  data_files:\n  - split: {split}\n"
        f"    path: data/{split}-*\n---\n",
        encoding="utf-8",
    )
    return root


def b_cfg(name: str, repo: Path, cache: Path, **extra: object):
    cfg = OmegaConf.load(DATASET_DIR / f"{name}.yaml")
    cfg.hf_id = str(repo)
    cfg.cache_dir = str(cache)
    for key, value in extra.items():
        cfg[key] = value
    return cfg


def by_id(prompts: PromptSet) -> dict[str, Prompt]:
    return {p.id: p for p in prompts}


def test_b3_code_single_turn(tmp_path: Path) -> None:
    rows = [
        {
            "lang": "python",
            "raw_index": 10 + i,
            "index": i,
            "seed": "def f(): ...",
            "openai_fingerprint": "fp_x",
            "problem": f"Write function number {i}.",
            "solution": "def f(): return 1",
        }
        for i in range(5)
    ]
    rows[3]["problem"] = "   "
    repo = hub_repo(tmp_path / "magicoder", rows)
    prompts = load_prompts(b_cfg("B3", repo, tmp_path / "cache", num_samples=None))
    got = by_id(prompts)
    assert sorted(got) == ["train-0", "train-1", "train-2", "train-4"]
    assert got["train-2"] == Prompt(
        "train-2", [{"role": "user", "content": "Write function number 2."}], None
    )
    assert prompts.skipped == {"empty_prompt": 1}


def test_b4_math_messages_drop_solution(tmp_path: Path) -> None:
    rows = [
        {
            "source": "amc_aime",
            "problem": f"Compute {i}+{i}.",
            "solution": f"{2 * i}",
            "messages": [
                {"role": "user", "content": f"Compute {i}+{i}."},
                {"role": "assistant", "content": f"The answer is $\\boxed{{{2 * i}}}$."},
            ],
        }
        for i in range(4)
    ]
    repo = hub_repo(tmp_path / "numina", rows)
    got = by_id(load_prompts(b_cfg("B4", repo, tmp_path / "cache", num_samples=None)))
    assert len(got) == 4
    assert got["train-1"].messages == [{"role": "user", "content": "Compute 1+1."}]


R1_SYSTEM = (
    "Your role as an assistant involves thoroughly exploring questions ... <|begin_of_thought|>"
)


def test_b5_openthoughts_sharegpt(tmp_path: Path) -> None:
    rows = [
        {
            "system": R1_SYSTEM,
            "conversations": [
                {"from": "user", "value": f"Prove claim {i}."},
                {"from": "assistant", "value": "<|begin_of_thought|>...<|end_of_solution|>"},
            ],
        }
        for i in range(6)
    ]
    rows[4]["conversations"][0]["from"] = "narrator"
    repo = hub_repo(tmp_path / "openthoughts", rows)
    prompts = load_prompts(b_cfg("B5", repo, tmp_path / "cache", num_samples=3))
    got = list(prompts)
    assert len(got) == 3  # num_samples prompts, however many rows had to be skipped
    for prompt in got:
        # R1's formatting system prompt is deliberately not used; the R1 answer is dropped.
        index = int(prompt.id.removeprefix("train-"))
        assert prompt.messages == [{"role": "user", "content": f"Prove claim {index}."}]
    everything = load_prompts(b_cfg("B5", repo, tmp_path / "cache", num_samples=None))
    assert len(everything) == 5
    assert everything.skipped == {"unknown_role": 1}
    assert everything.skipped_examples == {"unknown_role": ["train-4"]}


def wildchat_turn(role: str, content: str) -> dict:
    return {
        "content": content,
        "role": role,
        "language": "French",
        "country": "France",
        "toxic": False,
        "redacted": False,
        "turn_identifier": 1,
    }


def test_b6_wildchat_multiturn_and_duplicate_hash(tmp_path: Path) -> None:
    history = [
        wildchat_turn("user", "Bonjour !"),
        wildchat_turn("assistant", "Bonjour, comment puis-je vous aider ?"),
        wildchat_turn("user", "Écris un haïku sur la mer."),
        wildchat_turn("assistant", "Vagues sans repos..."),
    ]
    rows = [
        {
            "conversation_hash": "h1",
            "model": "gpt-4-0314",
            "conversation": history,
            "turn": 2,
            "language": "French",
        },
        {
            "conversation_hash": "h2",
            "model": "gpt-3.5-turbo-0613",
            "conversation": [wildchat_turn("user", "你好"), wildchat_turn("assistant", "你好！")],
            "turn": 1,
            "language": "Chinese",
        },
        {
            "conversation_hash": "h1",
            "model": "gpt-4-0314",
            "conversation": history,
            "turn": 2,
            "language": "French",
        },
    ]
    repo = hub_repo(tmp_path / "wildchat", rows)
    prompts = load_prompts(b_cfg("B6", repo, tmp_path / "cache", seed=None))
    got = by_id(prompts)
    assert got["h1"].messages == [
        {"role": "user", "content": "Bonjour !"},
        {"role": "assistant", "content": "Bonjour, comment puis-je vous aider ?"},
        {"role": "user", "content": "Écris un haïku sur la mer."},
    ]
    assert got["h2"].messages == [{"role": "user", "content": "你好"}]
    assert prompts.skipped == {"duplicate_id": 1}


XLAM_TOOLS = [
    {
        "name": "live_giveaways_by_type",
        "description": "Retrieve live giveaways from the GamerPower API based on the type.",
        "parameters": {
            "type": {
                "description": "The type of giveaways (e.g. game, loot).",
                "type": "str",
                "default": "game",
            },
        },
    },
    {
        "name": "get_prime_factors",
        "description": "Prime factors of n.",
        "parameters": {
            "n": {"description": "The number.", "type": "int"},
            "limit": {"description": "Max factors.", "type": "int, optional"},
            "bases": {"description": "Bases.", "type": "List[int]"},
            "cb": {"description": "Callback.", "type": "Callable"},
        },
    },
]


def test_b7_xlam_tools_become_openai_tools(tmp_path: Path) -> None:
    rows = [
        {
            "id": 7,
            "query": "Where can I find live giveaways for beta access and games?",
            "answers": json.dumps(
                [{"name": "live_giveaways_by_type", "arguments": {"type": "beta"}}]
            ),
            "tools": json.dumps(XLAM_TOOLS),
        },
        {"id": 8, "query": "Factor 12", "answers": "[]", "tools": "{broken"},
    ]
    repo = hub_repo(tmp_path / "xlam", rows)
    prompts = load_prompts(b_cfg("B7", repo, tmp_path / "cache"))
    got = by_id(prompts)
    assert list(got) == ["7"]
    prompt = got["7"]
    assert prompt.messages == [
        {"role": "user", "content": "Where can I find live giveaways for beta access and games?"}
    ]
    assert prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "live_giveaways_by_type",
                "description": "Retrieve live giveaways from the GamerPower API based on the type.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "type": {
                            "type": "string",
                            "default": "game",
                            "description": "The type of giveaways (e.g. game, loot).",
                        },
                    },
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "get_prime_factors",
                "description": "Prime factors of n.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "description": "The number."},
                        "limit": {"type": "integer", "description": "Max factors."},
                        "bases": {"type": "array", "description": "Bases."},
                        "cb": {"description": "Callback."},
                    },
                    "required": ["n", "bases", "cb"],
                },
            },
        },
    ]
    assert prompts.skipped == {"invalid_tools": 1}


def swe_turn(role: str, text: str) -> dict:
    return {
        "cutoff_date": "2024-01-01",
        "mask": role != "ai",
        "role": role,
        "system_prompt": "SWE-agent",
        "text": text,
    }


def test_b8_swe_agent_trajectory(tmp_path: Path) -> None:
    trajectory = [
        swe_turn("system", "SETTING: You are an autonomous programmer ..."),
        swe_turn(
            "user", "We're currently solving the following issue ...\n(Open file: n/a)\nbash-$"
        ),
        swe_turn("ai", "Let's reproduce the bug.\n```\ncreate reproduce.py\n```"),
        swe_turn("user", "[File: /repo/reproduce.py (1 lines total)]\n(Open file: reproduce.py)"),
        swe_turn("ai", "DISCUSSION\nThe fix works.\n```\nsubmit\n```"),
    ]
    rows = [
        {
            "instance_id": "astropy__astropy-1",
            "model_name": "swe-agent-llama-70b",
            "target": True,
            "trajectory": trajectory,
            "exit_status": "submitted",
            "generated_patch": "diff --git a/x b/x",
            "eval_logs": "PASSED",
        },
        {
            "instance_id": "astropy__astropy-1",
            "model_name": "swe-agent-llama-8b",
            "target": False,
            "trajectory": trajectory[:3],
            "exit_status": "exit_cost",
            "generated_patch": "",
            "eval_logs": "",
        },
        {
            "instance_id": "django__django-2",
            "model_name": "swe-agent-llama-8b",
            "target": False,
            "trajectory": [trajectory[0], trajectory[2]],
            "exit_status": "early_exit",
            "generated_patch": "",
            "eval_logs": "",
        },
    ]
    repo = hub_repo(tmp_path / "swe", rows)
    prompts = load_prompts(b_cfg("B8", repo, tmp_path / "cache", seed=None))
    got = by_id(prompts)
    assert got["train-0"].messages == [
        {"role": "system", "content": "SETTING: You are an autonomous programmer ..."},
        {"role": "user", "content": trajectory[1]["text"]},
        {"role": "assistant", "content": trajectory[2]["text"]},
        {"role": "user", "content": trajectory[3]["text"]},
    ]
    assert got["train-1"].messages[-1] == {"role": "user", "content": trajectory[1]["text"]}
    assert got["train-0"].tools is None
    # system + ai only: nothing left to answer once the ai turn is dropped.
    assert prompts.skipped == {"no_turn_to_answer": 1}


def test_all_dataset_configs_are_consistent() -> None:
    files = sorted(DATASET_DIR.glob("*.yaml"))
    assert {f.stem for f in files} >= {"jsonl", "B3", "B4", "B5", "B6", "B7", "B8"}
    for file in files:
        cfg = OmegaConf.load(file)
        assert cfg.name == file.stem, file
        if cfg.source == "hf":
            assert "/" in cfg.hf_id and cfg.split and cfg.seed is not None, file
            assert cfg.mapping.kind in {"conversation", "single_turn"}, file
            assert cfg.num_samples > 0 and cfg.drop_trailing_assistant is True, file


# --- selection, streaming, data_files, wire shapes -------------------------------------


def generic_cfg(**values: object):
    base = {
        "name": "local",
        "source": "hf",
        "split": "train",
        "seed": 3,
        "num_samples": None,
        "streaming": False,
        "drop_trailing_assistant": True,
        "mapping": {"kind": "single_turn", "prompt_field": "q", "id_field": "key"},
    }
    base.update(values)
    return OmegaConf.create(base)


def test_seeded_selection_is_shuffle_then_take(tmp_path: Path) -> None:
    from datasets import Dataset

    rows = [{"key": f"k{i}", "q": f"question {i}"} for i in range(40)]
    path = tmp_path / "rows.parquet"
    Dataset.from_list(rows).to_parquet(str(path))
    cfg = generic_cfg(data_files=str(path), num_samples=10, cache_dir=str(tmp_path / "c"))
    first = [p.id for p in load_prompts(cfg)]
    expected = Dataset.from_list(rows).shuffle(seed=3)["key"][:10]
    assert first == list(expected)
    assert [p.id for p in load_prompts(cfg)] == first  # same seed, same prompts
    cfg.seed = 4
    assert [p.id for p in load_prompts(cfg)] != first
    cfg.seed = None
    assert [p.id for p in load_prompts(cfg)] == [f"k{i}" for i in range(10)]


def test_streaming_is_deterministic_and_covers_the_same_rows(tmp_path: Path) -> None:
    rows = [{"key": f"k{i}", "q": f"question {i}"} for i in range(30)]
    repo = hub_repo(tmp_path / "repo", rows)
    cfg = generic_cfg(
        hf_id=str(repo),
        hf_config="default",
        cache_dir=str(tmp_path / "c"),
        streaming=True,
        shuffle_buffer=8,
    )
    # Few passes on purpose: datasets 5.2 sleeps 5 s after each shuffled stream pass.
    streamed = list(load_prompts(cfg))
    assert sorted(p.id for p in streamed) == sorted(r["key"] for r in rows)
    assert [p.id for p in streamed] != [r["key"] for r in rows]  # it did shuffle
    cfg.num_samples = 12
    assert [p.id for p in load_prompts(cfg)] == [p.id for p in streamed[:12]]  # same order


def test_data_files_jsonl_openai_rows_with_tool_turns(tmp_path: Path) -> None:
    from datasets import Dataset

    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    rows = [
        {
            "uid": "r1",
            "tools": [WEATHER_TOOL],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "functions.get_weather:0"},
                {"role": "assistant", "content": "It is sunny."},
            ],
        },
    ]
    path = tmp_path / "rows.jsonl"
    Dataset.from_list(rows).to_json(str(path))  # Arrow unifies turns: absent keys -> null
    cfg = generic_cfg(
        data_files=str(path),
        cache_dir=str(tmp_path / "c"),
        mapping={
            "kind": "conversation",
            "messages_field": "messages",
            "id_field": "uid",
            "tools_field": "tools",
            "tools_format": "openai",
        },
    )
    (prompt,) = list(load_prompts(cfg))
    assert prompt.id == "r1"
    assert prompt.messages == rows[0]["messages"][:3]  # null keys dropped, answer dropped
    assert prompt.tools is not None
    assert prompt.tools[0]["function"]["name"] == "get_weather"
    assert prompt.tools[0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}


def test_hub_unreachable_gives_clear_error(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    code = (
        "from omegaconf import OmegaConf\n"
        "from kimi_pipe.store.prompt_datasets import load_prompts\n"
        f"load_prompts(OmegaConf.load({str(DATASET_DIR / 'B5.yaml')!r}))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_DATASETS_CACHE", None)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "open-thoughts/OpenThoughts-114k" in result.stderr
    assert "dataset=jsonl" in result.stderr and "HF_HOME" in result.stderr


def test_unknown_mapping_kind_is_a_config_error(tmp_path: Path) -> None:
    from datasets import Dataset

    path = tmp_path / "rows.parquet"
    Dataset.from_list([{"key": "a", "q": "x"}]).to_parquet(str(path))
    cfg = generic_cfg(data_files=str(path), mapping={"kind": "mystery"})
    with pytest.raises(ValueError, match="mystery"):
        load_prompts(cfg)


def test_hydra_group_selection_and_overrides(tmp_path: Path) -> None:
    """`dataset=B5 dataset.num_samples=...` as a user types it, through the shared config."""
    from hydra import compose, initialize_config_dir

    rows = [{"system": "", "conversations": [{"from": "user", "value": f"Q{i}"}]} for i in range(4)]
    repo = hub_repo(tmp_path / "ot", rows)
    jsonl = write_lines(tmp_path / "p.jsonl", [{"id": "x", "messages": [USER]}])
    # The whole config (a group deleted with ~GROUP no longer composes: each group's option
    # schema is chosen by its choice, conf/config.yaml's `${GROUP}`).
    others: list[str] = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "dataset=B5",
                f"dataset.hf_id={repo}",
                f"dataset.cache_dir={tmp_path / 'cache'}",
                "dataset.num_samples=3",
                *others,
            ],
        )
        default = compose("config", overrides=[f"dataset.path={jsonl}", *others])
    assert cfg.dataset.name == "B5"
    prompts = list(load_prompts(cfg.dataset))
    assert len(prompts) == 3
    assert {p.messages[0]["content"] for p in prompts} <= {"Q0", "Q1", "Q2", "Q3"}
    assert default.dataset.name == "jsonl"
    assert [p.id for p in load_prompts(default.dataset)] == ["x"]
