"""Fixtures for the generate stage: the fake OpenRouter server and run helpers.

Registered by tests/conftest.py (`pytest_plugins` picks up conftest_*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kimi_pipe.core.models import Model
from tests.support.fake_openrouter import Behaviour, FakeOpenRouter, KimiCounter

REPO = Path(__file__).resolve().parents[2]
FAKE_KEY = "sk" + "-or-v1-FAKE-test-key-of-kimi-pipe-0123-DEADBEEF"  # recognisable, not a real key


@pytest.fixture
def fake_openrouter(kimi: Model) -> Iterator[Callable[..., FakeOpenRouter]]:
    """Factory: `fake_openrouter(default=Behaviour(...), behaviours={...})` starts a server
    on a free 127.0.0.1 port that counts tokens with the real Kimi tokenizer; every server
    started is shut down after the test."""
    servers: list[FakeOpenRouter] = []
    counter = KimiCounter(kimi)

    def start(
        default: Behaviour | None = None, behaviours: dict[str, Behaviour] | None = None
    ) -> FakeOpenRouter:
        def exact(b: Behaviour) -> Behaviour:
            b.counter = counter
            return b

        srv = FakeOpenRouter(
            exact(default or Behaviour()), {k: exact(v) for k, v in (behaviours or {}).items()}
        )
        servers.append(srv.start())
        return srv

    yield start
    for srv in servers:
        srv.stop()


def write_prompts(
    path: Path,
    n: int,
    tools_every: int = 0,
    prefix: str = "s",
    text: Callable[[int], str] | None = None,
) -> list[str]:
    """A JSONL prompt file of `n` records; every `tools_every`-th one declares a tool."""
    ids = []
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            rid = f"{prefix}{i}"
            question = text(i) if text else f"Question {rid}: what is {i}+{i}?"
            rec: dict[str, Any] = {
                "id": rid,
                "messages": [
                    {"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": question},
                ],
            }
            if tools_every and i % tools_every == 0:
                rec["tools"] = [
                    {
                        "type": "function",
                        "function": {
                            "name": "calc",
                            "description": "Evaluate an arithmetic expression",
                            "parameters": {
                                "type": "object",
                                "properties": {
                                    "expr": {"type": "string", "description": "the expression"}
                                },
                                "required": ["expr"],
                            },
                        },
                    }
                ]
            fh.write(json.dumps(rec) + "\n")
            ids.append(rid)
    return ids


def base_overrides(
    prompts: Path, url: str, out: Path, kimi_dir: Path, usd: float = 10.0, concurrency: int = 8
) -> list[str]:
    return [
        "dataset=jsonl",
        f"dataset.path={prompts}",
        "model=kimi_k25",
        f"model.tokenizer.path={kimi_dir}",
        "provider=openrouter",
        f"provider.api_base={url}",
        f"budget.usd={usd}",
        f"output_dir={out}",
        f"provider.concurrency={concurrency}",
        "provider.params.max_tokens=512",
        "provider.retry.base_delay_s=0.01",
        "provider.retry.max_delay_s=0.05",
        "provider.timeout_s=5",
        *SERVING_AS_IS,
    ]


# These tests measure the stage itself (serving=auto's probes: test_serving_auto.py). The fake
# OpenRouter hands tool arguments back as the model wrote them (no parser's `\s*` around
# them): declared, so its tool calls are proven as they are there.
SERVING_AS_IS = ("serving=unknown", "serving.argument_edges=kept")


def run_inprocess(overrides: Sequence[str], out: Path) -> tuple[int, dict | None]:
    """The stage in this process (no Hydra run dir files; fast)."""
    from kimi_pipe.config import compose
    from kimi_pipe.stages.generate import generate

    return generate(compose(list(overrides)), out)


def prompts_and_run(
    tmp_path: Path,
    url: str,
    kimi_dir: Path,
    n: int = 2,
    name: str = "run",
    usd: float = 10.0,
    concurrency: int = 8,
    **kw: Any,
) -> tuple[Path, list[str], list[str]]:
    """`n` prompts in `<tmp>/<name>.jsonl` (write_prompts' options in `kw`) and the
    overrides of a run of them into `<tmp>/<name>`: (run directory, overrides, prompt ids)."""
    prompts = tmp_path / f"{name}.jsonl"
    ids = write_prompts(prompts, n, **kw)
    out = tmp_path / name
    return out, base_overrides(prompts, url, out, kimi_dir, usd=usd, concurrency=concurrency), ids


def run_prompts(
    tmp_path: Path,
    url: str,
    kimi_dir: Path,
    n: int = 4,
    extra: Sequence[str] = (),
    **kw: Any,
) -> tuple[int, dict | None, Path, list[str]]:
    """`prompts_and_run`, run in this process: (status, summary, run directory, ids)."""
    out, overrides, ids = prompts_and_run(tmp_path, url, kimi_dir, n, **kw)
    status, summary = run_inprocess([*overrides, *extra], out)
    return status, summary, out, ids


def generate_cmd(overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "kimi_pipe", "generate", *overrides]


def subprocess_env(key: str | None = FAKE_KEY) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OPENROUTER_API_KEY", None)
    if key is not None:
        env["OPENROUTER_API_KEY"] = key
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_subprocess(
    overrides: Sequence[str], key: str | None = FAKE_KEY, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        generate_cmd(overrides),
        cwd=REPO,
        env=subprocess_env(key),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def records_by_id(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_jsonl(path)}


@pytest.fixture
def api_key_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OPENROUTER_API_KEY", FAKE_KEY)
    return FAKE_KEY
