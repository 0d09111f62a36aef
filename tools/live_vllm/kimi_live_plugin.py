"""vLLM plugin for tools/make_live_vllm_corpus.py: runs INSIDE the vLLM venv, never in CI.

Two pieces a stock vLLM server lacks offline, and nothing else:
- `KimiTikTokenTokenizer`: Moonshot's slow `TikTokenTokenizer` surface (tiktoken BPE over the
  two data files, tokens as GPT-2 byte-level strings, added tokens by name, special ids from
  tokenizer_config.json). Moonshot's Python file needs the Hub and `trust_remote_code`; this
  class executes nothing from a model directory. Being slow (`is_fast = False`), vLLM decodes
  it with its own SlowIncrementalDetokenizer, as it does the real Kimi tokenizer.
- `ScriptedIdsProcessor`: a V1 logits processor that allows exactly one next id, the next
  entry of the request's `vllm_xargs["script"]`, so the random model emits the ground truth.
The tokenizer is registered as tokenizer mode `kimi_tiktoken` (rendered by vLLM's HfRenderer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tiktoken
import torch
from kimi_slow_vocab import byte_chars, load_kimi_vocab  # copied beside this file
from transformers import BatchEncoding
from transformers.utils import chat_template_utils
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

MODE = "kimi_tiktoken"
# Kimi K2.5's pre-tokenizer (docs/kimi-k25-format.md, "Tokenizer"); tiktoken reads `&&`.
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
END_OF_TURN = "<|im_end|>"


class KimiTikTokenTokenizer:
    """vLLM `TokenizerLike` over Kimi's tiktoken.model + tokenizer_config.json."""

    is_fast = False

    @classmethod
    def from_pretrained(cls, path_or_repo_id: Any, *args: Any, **kwargs: Any) -> Any:
        return cls(Path(path_or_repo_id), kwargs.get("truncation_side", "left"))

    def __init__(self, directory: Path, truncation_side: str = "left") -> None:
        self.name_or_path = str(directory)
        self.truncation_side = truncation_side
        vocab = load_kimi_vocab(directory)
        ranks = {token: i for i, token in vocab.ranks.items()}
        config, self.added = vocab.config, vocab.added
        self.encoding = tiktoken.Encoding(
            name="kimi_k25",
            pat_str=KIMI_PAT,
            mergeable_ranks=ranks,
            special_tokens={name: i for i, name in self.added.items()},
        )
        self.all_special_tokens = vocab.special
        self.all_special_ids = [i for i, name in self.added.items() if name in vocab.special]
        chars = byte_chars()
        self.char_bytes = {c: b for b, c in chars.items()}
        self.id_token = {i: "".join(chars[b] for b in t) for t, i in ranks.items()}
        self.id_token.update(self.added)
        self.vocab = {t: i for i, t in self.id_token.items()}
        self.added_vocab = {name: i for i, name in self.added.items()}
        names = {name: i for i, name in self.added.items()}
        self.bos_token_id = names[config["bos_token"]]
        self.eos_token_id = names[END_OF_TURN]  # K2.5 config.json: eos_token_id 163586
        self.pad_token_id = names[config["pad_token"]]
        self.vocab_size = len(self.id_token)
        self.max_token_id = self.vocab_size - 1
        self.max_chars_per_token = max(len(t) for t in self.id_token.values())

    def __hash__(self) -> int:
        return hash(self.name_or_path)

    def __len__(self) -> int:
        return self.vocab_size

    def num_special_tokens_to_add(self) -> int:
        return 0

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_vocab

    def encode(
        self,
        text: str,
        truncation: bool | None = None,
        max_length: int | None = None,
        add_special_tokens: bool = True,
        **_: Any,
    ) -> list[int]:
        # Moonshot's encode recognises every special/reserved name (allowed_special="all"):
        # right for the rendered prompt, which is all this server encodes.
        ids = self.encoding.encode(text, allowed_special="all")
        if truncation and max_length is not None and len(ids) > max_length:
            ids = ids[-max_length:] if self.truncation_side == "left" else ids[:max_length]
        return ids

    def __call__(self, text: Any, text_pair: Any = None, **kwargs: Any) -> BatchEncoding:
        if isinstance(text, list):
            batch = [self.encode(t, **kwargs) for t in text]
            return BatchEncoding(
                {"input_ids": batch, "attention_mask": [[1] * len(b) for b in batch]}
            )
        ids = self.encode(text, **kwargs)
        return BatchEncoding({"input_ids": ids, "attention_mask": [1] * len(ids)})

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self.vocab[tokens]
        return [self.vocab[t] for t in tokens]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self.id_token[ids]
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.id_token[i] for i in ids if i not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray()
        for token in tokens:
            if token in self.added_vocab:
                data += token.encode()
            else:
                data += bytes(self.char_bytes[c] for c in token)
        return data.decode("utf-8", errors="replace")

    def decode(self, ids: Any, skip_special_tokens: bool = False, **_: Any) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids, skip_special_tokens))

    def get_chat_template(self, chat_template: str | None, tools: Any = None) -> str | None:
        return chat_template

    def apply_chat_template(
        self,
        messages: Any = None,
        tools: Any = None,
        chat_template: str | None = None,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> Any:
        conversation = messages if messages is not None else kwargs.pop("conversation")
        kwargs.pop("conversation", None)
        # render_jinja_template takes a batch of conversations.
        rendered, _ = chat_template_utils.render_jinja_template(
            [conversation], chat_template=chat_template, tools=tools, **kwargs
        )
        prompt = rendered[0] if rendered else ""
        return self.encode(prompt) if tokenize else prompt


class ScriptedIdsProcessor(AdapterLogitsProcessor):
    """Only `script[len(output_ids)]` may be sampled; requests without a script are untouched."""

    @classmethod
    def validate_params(cls, params: Any) -> None:
        script = (params.extra_args or {}).get("script")
        if script is not None and not all(isinstance(i, int) for i in script):
            raise ValueError("vllm_xargs.script must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins, greedy requests included

    def new_req_logits_processor(self, params: Any) -> Any:
        script = (params.extra_args or {}).get("script")
        if not script:
            return None

        def only_next(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step < len(script):
                allowed = torch.full_like(logits, float("-inf"))
                allowed[script[step]] = 0.0
                return allowed
            return logits

        return only_next


def register() -> None:
    """Entry point `vllm.general_plugins`: runs in the API server and in every engine process."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(MODE, __name__, "KimiTikTokenTokenizer")
    if MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(MODE, "vllm.renderers.hf", "HfRenderer")
