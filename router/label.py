"""Labels for our own tiers: run both over GSM8K questions, score their final numeric answers.

`sluice router label --dataset gsm8k --n 300 --out FILE` writes one training row per question
(`router.data` format: `prompt` is the question, `small_score` / `large_score` are 1 when that tier's
final number equals the reference, `small_confidence` and `small_stream_confidence` are
`router.confidence.answer_confidence` and `stream_confidence` of the small tier's answer). JSONL output
also keeps what the scores came from — both answers, the reference and the small tier's token logprobs and
both token counts — so the confidence study and the cascade benchmark need no rerun; `router.data.load_rows`
ignores those extra keys.

The tiers are any chat clients; the CLI builds the demo tiers' in-process engines one after the other
(only one model in memory), every question in flight at once (bounded) so the engine batches them. Each
tier's answers are appended to `<out>.<tier>.answers.jsonl` as they come and rows are joined from them,
so a rerun skips whatever either step already did (resumable).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from engines.api.protocol import ChatCompletion, ChatCompletionRequest, ChatMessage
from router.confidence import answer_confidence, stream_confidence
from router.data import TrainingRow, load_rows

DEFAULT_GSM8K_DIR = Path("../shared/data/gsm8k")
SYSTEM_PROMPT = (
    "Solve the math word problem. Reason briefly, in a few short lines, then write the final answer on the "
    "last line as `#### <number>`."
)
# Room for both tiers to finish: at 256 tokens about half of the small tier's answers and a third of the
# large tier's were cut (labels of 2026-12-02..05 in BENCHMARKS.md), which scored them wrong and made the
# whole-answer confidence look better than on finished answers; at 512 almost all finish.
MAX_ANSWER_TOKENS = 512
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FINAL = re.compile(r"####\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")
_BOXED = re.compile(r"\\boxed\{\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")


class ChatTier(Protocol):
    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion: ...


@dataclass(frozen=True, slots=True)
class Question:
    question: str
    answer: float  # the reference final number


@dataclass(frozen=True, slots=True)
class TierAnswer:
    text: str
    logprobs: list[float]  # chosen tokens' logprobs; empty when not asked for
    prompt_tokens: int
    completion_tokens: int


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The answer's final number: after `####` when present, else in the last `\\boxed{}` (what Qwen models
    write despite the prompt), else the last number in the text."""
    marked = _FINAL.findall(text) or _BOXED.findall(text)
    if marked:
        return _to_number(marked[-1])
    numbers = _NUMBER.findall(text)
    return _to_number(numbers[-1]) if numbers else None


def is_correct(text: str, reference: float) -> bool:
    value = final_number(text)
    return value is not None and math.isclose(value, reference, rel_tol=0.0, abs_tol=1e-6)


def load_gsm8k(directory: Path, split: str, n: int) -> list[Question]:
    """The first `n` questions of `<directory>/<split>.jsonl` (in file order, so runs are comparable)."""
    path = directory / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"GSM8K {split} split not found at {path}; see ../shared/data/README.md")
    questions = []
    with path.open() as f:
        for line in f:
            if len(questions) == n:
                break
            raw = json.loads(line)
            reference = final_number(raw["answer"])
            if reference is not None:
                questions.append(Question(raw["question"], reference))
    return questions


def chat_request(question: str, *, logprobs: bool, max_tokens: int = MAX_ANSWER_TOKENS) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="label",
        messages=[ChatMessage(role="system", content=SYSTEM_PROMPT), ChatMessage(role="user", content=question)],
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=logprobs,
    )


async def ask(tier: ChatTier, question: str, *, logprobs: bool) -> TierAnswer:
    response = await tier.chat(chat_request(question, logprobs=logprobs))
    choice = response.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None else None
    usage = response.usage
    return TierAnswer(
        choice.message.content or "", [t.logprob for t in content or []], usage.prompt_tokens, usage.completion_tokens
    )


def labelled_row(question: Question, small: TierAnswer, large: TierAnswer) -> dict[str, object]:
    row = TrainingRow(
        prompt=question.question,
        small_score=float(is_correct(small.text, question.answer)),
        large_score=float(is_correct(large.text, question.answer)),
        small_confidence=answer_confidence(small.logprobs) if small.logprobs else None,
        small_stream_confidence=stream_confidence(small.logprobs) if small.logprobs else None,
    )
    extras = {
        "reference": question.answer,
        "small_answer": small.text,
        "large_answer": large.text,
        "small_logprobs": [round(lp, 5) for lp in small.logprobs],
        "small_tokens": [small.prompt_tokens, small.completion_tokens],
        "large_tokens": [large.prompt_tokens, large.completion_tokens],
    }
    return {**asdict(row), **extras}


def done_prompts(out: Path) -> set[str]:
    return {row.prompt for row in load_rows(out)} if out.exists() else set()


def answers_path(out: Path, tier: str) -> Path:
    """Where one tier's answers are kept until both tiers have answered (`labels.small.answers.jsonl`)."""
    return out.with_name(f"{out.stem}.{tier}.answers.jsonl")


def load_answers(path: Path) -> dict[str, TierAnswer]:
    answers = {}
    if path.exists():
        with path.open() as f:
            for line in f:
                raw = json.loads(line)
                question = raw.pop("question")
                answers[question] = TierAnswer(**raw)
    return answers


async def answer_all(
    questions: Sequence[Question],
    tier: ChatTier,
    path: Path,
    *,
    logprobs: bool,
    concurrency: int = 16,
    on_done: Callable[[], None] = lambda: None,
) -> int:
    """Ask one tier every question not yet answered in `path`, appending each answer as it comes (all in
    flight at once, bounded, so the engine batches them); returns how many were asked."""
    known = load_answers(path)
    todo = [q for q in questions if q.question not in known]
    gate = asyncio.Semaphore(concurrency)
    path.parent.mkdir(parents=True, exist_ok=True)

    async def one(question: Question) -> None:
        async with gate:
            answer = await ask(tier, question.question, logprobs=logprobs)
        with path.open("a") as f:  # one write per line: no interleaving within the event loop
            f.write(json.dumps({"question": question.question, **asdict(answer)}) + "\n")
        on_done()

    await asyncio.gather(*(one(q) for q in todo))
    return len(todo)


def join_labels(questions: Sequence[Question], out: Path) -> int:
    """Append a training row for each question both tiers have answered and `out` lacks; returns how many."""
    small, large = (load_answers(answers_path(out, tier)) for tier in ("small", "large"))
    done = done_prompts(out)
    new = [q for q in questions if q.question in small and q.question in large and q.question not in done]
    with out.open("a") as f:
        for q in new:
            f.write(json.dumps(labelled_row(q, small[q.question], large[q.question])) + "\n")
    return len(new)


async def label(
    questions: Sequence[Question],
    small: ChatTier,
    large: ChatTier,
    out: Path,
    *,
    concurrency: int = 16,
) -> int:
    """Both tiers at once (when both fit in memory), then the rows; returns how many rows were added."""
    await asyncio.gather(
        answer_all(questions, small, answers_path(out, "small"), logprobs=True, concurrency=concurrency),
        answer_all(questions, large, answers_path(out, "large"), logprobs=False, concurrency=concurrency),
    )
    return join_labels(questions, out)


TierFactory = Callable[[str], Awaitable[tuple[ChatTier, Callable[[], Awaitable[None]]]]]


def run_label(
    dataset: str,
    n: int,
    split: str,
    out: Path,
    data_dir: Path,
    build_tier: TierFactory,
    concurrency: int,
    tiers: Sequence[str] = ("small", "large"),
) -> int:
    """The CLI's body: each tier in turn (only one model in memory at a time) answers the questions it
    has not answered yet, with a progress bar; then rows are written for questions both tiers answered.
    `tiers` limits the run to one tier (two processes may then answer side by side)."""
    from tqdm import tqdm

    if dataset != "gsm8k":
        raise ValueError(f"unknown dataset {dataset!r}; supported: gsm8k")
    if out.suffix != ".jsonl":
        raise ValueError(f"--out {out}: labels are written as JSONL (they keep both answers); name it *.jsonl")
    questions = load_gsm8k(data_dir, split, n)

    async def main() -> int:
        for name in tiers:
            path = answers_path(out, name)
            remaining = len({q.question for q in questions} - set(load_answers(path)))
            if not remaining:
                continue
            tier, close = await build_tier(name)
            try:
                with tqdm(total=remaining, desc=f"{name} tier, gsm8k/{split}", unit="q") as bar:
                    await answer_all(questions, tier, path, logprobs=name == "small", concurrency=concurrency,
                                     on_done=bar.update)
            finally:
                await close()
        return join_labels(questions, out)

    return asyncio.run(main())
