"""``lily score``: teacher-forced scoring of a token sequence."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch


def read_ids(path: str) -> list[int]:
    text = Path(path).read_text().strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(t) for t in text.split()]
    except ValueError as e:
        raise ValueError(f"{path}: expected a JSON list or whitespace-separated token ids") from e
    if not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: token ids must be integers")
    return ids


def score_ids(engine, ids: list[int]) -> tuple[dict, torch.Tensor]:
    """Per position t < T-1: log p(ids[t+1] | ids[:t+1]) and the top-1 id; plus perplexity."""
    if len(ids) < 2:
        raise ValueError("scoring needs at least two tokens")
    vocab = engine.cfg.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    logits = engine.score(ids)  # (T, V) fp32
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    target = torch.tensor(ids[1:])
    lp = logp.gather(1, target[:, None])[:, 0]
    top1 = logits[:-1].argmax(-1)
    nll = -lp.mean().item()
    result = {
        "model": engine.model_name,
        "num_tokens": len(ids),
        "token_ids": ids,
        "logprobs": [float(x) for x in lp],
        "top1": [int(x) for x in top1],
        "top1_matches_next": float((top1 == target).double().mean()),
        "mean_nll": nll,
        "perplexity": math.exp(nll),
    }
    return result, logits


def score_command(engine, args) -> int:
    if args.ids_file:
        ids = read_ids(args.ids_file)
    else:
        text = args.text if args.text is not None else Path(args.text_file).read_text()
        ids = engine.tokenizer.encode(text)
    result, logits = score_ids(engine, ids)
    if args.save_logits:
        np.save(args.save_logits, logits.float().numpy())
        result["logits_path"] = str(args.save_logits)
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0
