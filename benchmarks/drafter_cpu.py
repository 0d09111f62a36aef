"""Train the same EAGLE-3 drafter on an export with speculators' own training code, on CPU.

    INTEROP_VENV/bin/python -m benchmarks.drafter_cpu --export EXPORT --verifier MODEL_DIR \
        --seed 0 --steps 300 --out result.json

Runs in the trainers' venv (tools/interop.sh builds it) and never imports kimi_pipe. What
runs is speculators' (0.9.0): `TrainConfig.resolve` parses the export card's own
`speculators train` command (so `--hidden-states-backend fp8` comes from the card of an fp8
export), `build_draft_model` makes the drafter from the verifier, `create_train_val_loaders`
with the backend's own transfer (`FileTransfer`, or `FP8Transfer`, which dequantizes) loads the
data, `build_optimizers` makes the optimizer, and the drafter's own forward computes the loss
and metrics. Only the loop is written here, because its `Trainer` moves every batch to CUDA
device `local_rank`: zero grad, forward, backward, clip to 1.0, step, as `Trainer.train_epoch`
does, without autocast (float32 on CPU). Held-out figures come from its validation split
(the last `--train-data-ratio` rows, the same rows for every seed and every export made with
the same export seed), averaged over its fixed-order validation batches as `val_epoch` does.
`--eval-export REF` also scores the drafter on REF's held-out rows (the same rows: checked),
with REF's states and teacher, so that drafters trained on different stores meet one teacher.

`--heldout-export HELD` (benchmarks/prefix_drafter.sh: training sets that differ in their rows,
scored on one held-out set): the drafter trains on EVERY row of `--export` and is scored on
every row of HELD, a separate export, with HELD's states and teacher. The loaders are
speculators' own (`ArrowDataset` with `train_ratio=1.0`, its `_setup_dataloader` packing: the
training loader with the run's seed as `create_train_val_loaders` builds it, the held-out one
in the fixed order it gives its validation loader), because its `create_train_val_loaders`
requires a validation split inside the training export. Checked before training: HELD's card
asks for the same training command as the export's (apart from `--data-path` and
`--total-seq-len`: same layer ids, same hidden-states backend), no row of HELD has the input
ids of a row of the export, and no row of HELD is longer than `--seq-len` (its packing would
cut it). `val` then holds the figures on HELD; the default (no
`--heldout-export`) is unchanged.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any


def card_command(export: Path) -> list[str]:
    text = (export / "README.md").read_text()
    block = text.split("speculators train", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-vocab-size", type=int, default=2048)
    ap.add_argument(
        "--eval-export",
        type=Path,
        default=None,
        help="also score the drafter on this export's held-out rows (e.g. the bf16 one)",
    )
    ap.add_argument(
        "--heldout-export",
        type=Path,
        default=None,
        help="train on every row of --export, score on every row of this separate export",
    )
    ap.add_argument("--time-budget-s", type=float, default=0, help="stop early (recorded)")
    args_in = ap.parse_args()
    if args_in.heldout_export is not None and args_in.eval_export is not None:
        ap.error("--heldout-export and --eval-export are exclusive")

    import torch

    torch.set_num_threads(args_in.threads)
    from datasets import load_from_disk
    from hs_connectors import HiddenStatesBackend
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, parse_vocab_mappings
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader, create_train_val_loaders
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from speculators.train.utils import normalize_counted_metrics
    from speculators.train.vocab_mapping import save_token_frequency_distribution
    from transformers import set_seed

    # Its prepare-data step counts the answer tokens for the draft vocabulary: the same call.
    args_in.out.parent.mkdir(parents=True, exist_ok=True)
    freq = args_in.out.parent / f"token_freq-{args_in.export.name}.pt"
    rows = load_from_disk(str(args_in.export))
    rows.set_format(type="torch")
    save_token_frequency_distribution(rows, freq)
    argv = card_command(args_in.export)
    argv = [a.replace("TARGET_MODEL_DIR", args_in.verifier) for a in argv]
    argv += [
        "--verifier-name-or-path",
        args_in.verifier,
        "--total-seq-len",
        str(args_in.seq_len),
        "--seed",
        str(args_in.seed),
        "--lr",
        str(args_in.lr),
        "--num-layers",
        "1",
        # Its default flex attention has no backward on CPU; sdpa is one of its own choices.
        "--draft-attn-impl",
        "sdpa",
        # Its fused loss needs Triton (GPU); eager is its own CPU-capable implementation.
        "--loss-implementation",
        "eager",
        "--save-path",
        str(args_in.out.parent / f"ckpt-{args_in.out.stem}"),
        "--num-workers",
        "0",
        "--token-freq-path",
        str(freq),
        "--draft-vocab-size",
        str(args_in.draft_vocab_size),
    ]
    cfg = TrainConfig.resolve(argv)
    args = argparse.Namespace(**cfg.flatten())
    set_seed(args.seed)
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry["eagle3"]
    draft = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size).float()

    # What its datasets do with a row whose states are missing (regenerate through a vLLM
    # endpoint, or not): the same for every loader here.
    missing_rows = {
        "vllm_endpoint": args.vllm_endpoint,
        "on_missing": args.on_missing,
        "request_timeout": args.request_timeout,
        "max_retries": args.max_retries,
        "generation_validation_retries": args.generation_validation_retries,
        "max_consecutive_generation_failures": args.max_consecutive_generation_failures,
    }

    def loaders(data_path: str, backend: str) -> tuple[Any, Any]:
        """Its train / validation loaders over one export, read by the backend its card names."""
        transfer = HiddenStatesBackend.registry[backend].from_train_args(args, data_path)
        return create_train_val_loaders(
            data_path=data_path,
            total_seq_len=args.total_seq_len,
            hidden_states_dtype=torch.float32,
            transfer=transfer,
            verifier_name_or_path=args.verifier_name_or_path,
            **missing_rows,
            hidden_size=draft.config.transformer_layer_config.hidden_size,
            num_target_layers=len(draft.target_layer_ids),
            num_workers=0,
            prefetch_factor=args.prefetch_factor,
            preprocess=shift_batch,
            train_data_ratio=args.train_data_ratio,
            seed=args.seed,
        )

    def whole_loader(data_path: str, backend: str, seed: int) -> Any:
        """Its loader over EVERY row of one export (--heldout-export): its ArrowDataset and
        packing, built as create_train_val_loaders builds its loaders, without a split."""
        transfer = HiddenStatesBackend.registry[backend].from_train_args(args, data_path)
        dataset = ArrowDataset(
            datapath=data_path,
            max_len=args.total_seq_len,
            transfer=transfer,
            train_ratio=1.0,
            split="train",
            model=args.verifier_name_or_path,
            hidden_states_dtype=torch.float32,
            **missing_rows,
        )
        return _setup_dataloader(
            dataset,
            args.total_seq_len,
            draft.config.transformer_layer_config.hidden_size,
            num_target_layers=len(draft.target_layer_ids),
            num_workers=0,
            prefetch_factor=args.prefetch_factor,
            preprocess=shift_batch,
            seed=seed,
        )

    def card_settings(export: Path) -> list[str]:
        """The card's training command without what differs between any two exports."""
        argv, out = card_command(export), []
        skip = False
        for a in argv:
            if skip:
                skip = False
            elif a in ("--data-path", "--total-seq-len"):
                skip = True
            else:
                out.append(a)
        return out

    def rows_of(path: Path) -> list[list[int]]:
        return [list(map(int, r)) for r in load_from_disk(str(path)).with_format(None)["input_ids"]]

    heldout = None
    if args_in.heldout_export is not None:
        if card_settings(args_in.heldout_export) != card_settings(args_in.export):
            raise SystemExit(
                f"{args_in.heldout_export}'s card asks for another training command than "
                f"{args_in.export}'s: {card_settings(args_in.heldout_export)} vs "
                f"{card_settings(args_in.export)}"
            )
        trained = {tuple(r) for r in rows_of(args_in.export)}
        held_rows = rows_of(args_in.heldout_export)
        shared = sum(tuple(r) in trained for r in held_rows)
        if shared:
            raise SystemExit(
                f"{shared} rows of {args_in.heldout_export} are rows of {args_in.export}"
            )
        longest = max(map(len, held_rows))
        if longest > args.total_seq_len:
            raise SystemExit(
                f"a held-out row of {longest} ids is longer than --seq-len "
                f"{args.total_seq_len}: its packing would cut or drop it"
            )
        train_loader = whole_loader(args.data_path, args.hidden_states_backend, args.seed)
        # Fixed order, as its validation loader (default seed): every drafter, same batches.
        val_loader = whole_loader(str(args_in.heldout_export), args.hidden_states_backend, 0)
        heldout = {
            "heldout_export": str(args_in.heldout_export),
            "heldout_rows": len(held_rows),
            "heldout_loss_tokens": int(
                sum(sum(m) for m in load_from_disk(str(args_in.heldout_export))["loss_mask"])
            ),
            "train_rows": len(rows),
            "train_tokens": int(sum(int(n) for n in rows["seq_len"])),
            "train_loss_tokens": int(sum(int(m.sum()) for m in rows["loss_mask"])),
        }
    else:
        train_loader, val_loader = loaders(args.data_path, args.hidden_states_backend)
    reference_loader = None
    if args_in.eval_export is not None:
        # The same held-out rows (same records, same export seed), states and teacher from the
        # reference export: every drafter is scored against one teacher.
        def ids_of(path: Path) -> list[list[int]]:
            return list(load_from_disk(str(path)).with_format(None)["input_ids"])

        if ids_of(args_in.eval_export) != ids_of(args_in.export):
            raise SystemExit(f"{args_in.eval_export} does not hold the same rows in the same order")
        backend = (
            "fp8"
            if "--hidden-states-backend fp8" in " ".join(card_command(args_in.eval_export))
            else "file"
        )
        reference_loader = loaders(str(args_in.eval_export), backend)[1]
    train_kw, val_kw = model_class.get_trainer_kwargs(**vars(args))
    trainer_cfg = TrainerConfig(
        lr=args.lr,
        num_epochs=1,
        save_path=args.save_path,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        muon_lr=args.muon_lr,
        muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn,
    )
    optimizers = build_optimizers(draft, trainer_cfg)

    def batches():
        epoch = 0
        while True:
            if hasattr(train_loader.batch_sampler, "set_epoch"):
                train_loader.batch_sampler.set_epoch(epoch)
            yield from train_loader
            epoch += 1

    started = time.monotonic()
    draft.train()
    losses = []
    for step, batch in zip(range(args_in.steps), batches(), strict=False):
        batch = {k: v for k, v in batch.items() if k != "error_records"}
        _tokens, loss, _metrics = draft(**batch, **train_kw)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        losses.append(float(loss.detach()))
        if step % 25 == 0:
            print(f"step {step} loss {float(loss):.4f}", flush=True)
        if args_in.time_budget_s and time.monotonic() - started > args_in.time_budget_s:
            print(f"time budget hit after {step + 1} steps", flush=True)
            break
    train_s = time.monotonic() - started
    draft.eval()

    def evaluate(loader: Any) -> tuple[dict[str, float], int]:
        total: dict[str, float] = {}
        n = 0
        with torch.no_grad():
            for batch in loader:
                batch = {k: v for k, v in batch.items() if k != "error_records"}
                _tokens, _loss, metrics = draft(**batch, **val_kw)
                for k, v in metrics.items():
                    total[k] = total.get(k, 0.0) + float(v)
                n += 1
        # As its val_epoch: the batch mean of each metric, then its own sum / total pairing
        # (loss, loss_i, full_acc_i: the draft's argmax = the teacher's at draft step i).
        return normalize_counted_metrics({k: v / max(n, 1) for k, v in total.items()}), n

    val, n = evaluate(val_loader)
    val_reference = evaluate(reference_loader)[0] if reference_loader is not None else None
    result = {
        "export": str(args_in.export),
        "backend": args.hidden_states_backend,
        "seed": args.seed,
        "steps": len(losses),
        "train_loss_first50": sum(losses[:50]) / max(len(losses[:50]), 1),
        "train_loss_last50": sum(losses[-50:]) / max(len(losses[-50:]), 1),
        # mean training loss per 100 steps: the curve, to see it fall
        "train_loss_per_100": [
            round(sum(losses[i : i + 100]) / len(losses[i : i + 100]), 4)
            for i in range(0, len(losses), 100)
        ],
        "val_batches": n,
        "val": val,
        "eval_export": str(args_in.eval_export) if args_in.eval_export else None,
        "val_on_eval_export": val_reference,
        "train_s": round(train_s, 1),
        # --heldout-export: `val` is on that export's rows; the rows and tokens of each
        **({"val_on": "heldout_export", **heldout} if heldout is not None else {}),
        "command": "speculators train " + " ".join(argv),
    }
    args_in.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("backend", "seed", "train_loss_last50")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
