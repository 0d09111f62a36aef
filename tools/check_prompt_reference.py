"""Prompt ids of kimi_pipe against a model's own reference tokenizer code (run by hand).

    python -m tools.check_prompt_reference --reference-dir DIR [--tokenizer-dir TOK]

DIR holds the reference `tokenization_kimi.py` (from the model's repository; it is
third-party code, so it is run only here, by hand, never by the pipeline or CI) and TOK the
tokenizer data files (default: the one kimi_pipe finds). Each prompt (the recorded Kimi
cases and the long-text and history cases of tests/test_prompt_reference.py) is rendered
with the test oracle template, then encoded as servers call the reference tokenizer
(`tok(text, add_special_tokens=False)`) and as a bare `tok.encode(text)`; both are compared
with `kimi_pipe.core.prompt_render.prompt_ids`. Exit 1 if any server-path ids differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def load_reference(reference_dir: Path, tokenizer_dir: Path) -> Any:
    import transformers.models.gpt2.tokenization_gpt2 as gpt2
    from transformers import AddedToken

    if not hasattr(gpt2, "bytes_to_unicode"):
        # transformers v5 moved it; the reference file still imports it from gpt2.
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        gpt2.bytes_to_unicode = bytes_to_unicode  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location(
        "reference_tokenization", reference_dir / "tokenization_kimi.py"
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"error: no tokenization_kimi.py in {reference_dir}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = {int(k): AddedToken(**v) for k, v in config["added_tokens_decoder"].items()}
    extra = {
        k: v for k, v in config.items() if k not in ("added_tokens_decoder", "tokenizer_class")
    }
    return module.TikTokenTokenizer(
        vocab_file=str(tokenizer_dir / "tiktoken.model"), added_tokens_decoder=added, **extra
    )


def cases() -> list[tuple[str, list[dict[str, Any]], Any]]:
    from tests import test_prompt_reference as t

    recorded = [
        json.loads(line)
        for line in (REPO / "tests/fixtures/kimi_k25_responses.jsonl").read_text().splitlines()
        if line.strip()
    ]
    out = [(c["id"], c["messages"], c.get("tools")) for c in recorded]
    out += [(p.id, p.values[0], p.values[1]) for p in t.LONG]
    for fields in ({"reasoning": "r"}, {"reasoning_content": None}, {"reasoning_content": "rc"}):
        out.append((f"history {fields}", t._turns(fields), None))
    null_arguments = t._turns({"reasoning_content": "r"})
    null_arguments[1]["tool_calls"][0]["function"]["arguments"] = None
    out.append(("null tool arguments", null_arguments, None))
    out.append(
        ("x + 25002 spaces + y", [{"role": "user", "content": "x" + " " * 25002 + "y"}], None)
    )
    return out


def main() -> int:
    from kimi_pipe.core.prompt_render import prompt_ids
    from kimi_pipe.core.tokenizers import TokenizerSpec, resolve_tokenizer_dir
    from tests.support.cases import load_or_skip
    from tests.support.kimi_reference import render_reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference-dir", type=Path, required=True)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    args = parser.parse_args()
    kimi = load_or_skip("kimi_k25")
    from omegaconf import OmegaConf

    spec = TokenizerSpec.from_config(
        OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/kimi_k25.yaml").tokenizer)  # type: ignore[arg-type]
    )
    tokenizer_dir = args.tokenizer_dir or resolve_tokenizer_dir(spec)
    reference = load_reference(args.reference_dir, tokenizer_dir)
    differ = 0
    for name, messages, tools in cases():
        if any("<|" in str(m.get("content")) for m in messages):
            continue  # marker text typed by a user: the reference turns it into ids on purpose
        text = render_reference(messages, tools)
        server = reference(text, add_special_tokens=False)["input_ids"]
        bare = reference.encode(text)
        ours = prompt_ids(kimi, messages, tools)
        differ += ours != server
        note = "" if bare == server else f"; bare encode() {len(bare)}"
        print(f"{'same' if ours == server else 'DIFF'}  {name}: {len(ours)} ids{note}")
    print(f"{differ} prompts differ from the reference tokenizer's server path")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
