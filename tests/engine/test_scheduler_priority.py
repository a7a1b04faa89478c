"""Priority classes: interactive sequences are admitted first and take what running batch sequences hold."""

from __future__ import annotations

from engines.block_manager import BlockManager
from engines.llm_engine import LLMEngine
from engines.sampling_params import SamplingParams
from engines.scheduler import ScheduledBatch, Scheduler
from engines.sequence import Sequence, SequenceStatus
from tests.engine.conftest import TinyModel, generated_ids, make_engine, run_to_completion
from tests.engine.test_scheduler import make_scheduler, step


def add(scheduler: Scheduler, request_id: str, num_prompt_tokens: int, priority: str = "interactive") -> Sequence:
    params = SamplingParams(priority=priority)  # type: ignore[arg-type]
    seq = Sequence(request_id, list(range(100, 100 + num_prompt_tokens)), params)
    scheduler.add(seq)
    return seq


def test_waiting_interactive_sequences_are_admitted_before_batch_ones_that_came_earlier() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, max_batch_tokens_beside_interactive=4)
    add(scheduler, "b1", 4, "batch")
    add(scheduler, "b2", 4, "batch")
    add(scheduler, "i1", 4)
    assert step(scheduler) == {"i1": 4}  # batch work sits out an interactive prefill
    assert step(scheduler) == {"i1": 1, "b1": 4}  # beside interactive work, at most 4 batch tokens a step
    assert step(scheduler) == {"i1": 1, "b1": 1, "b2": 3}
    assert step(scheduler) == {"i1": 1, "b1": 1, "b2": 1}


def test_an_interactive_sequence_takes_the_slot_of_the_latest_batch_sequence() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16, max_batch_tokens_beside_interactive=4)
    b1, b2 = add(scheduler, "b1", 4, "batch"), add(scheduler, "b2", 4, "batch")
    assert step(scheduler) == {"b1": 4, "b2": 4}
    i1 = add(scheduler, "i1", 4)
    # No slot left: b2 (admitted last) is preempted and recomputed later; i1 is prefilled at once, alone.
    assert step(scheduler) == {"i1": 4}
    assert (b2.status, b2.num_computed_tokens, scheduler.num_preempted_total) == (SequenceStatus.WAITING, 0, 1)
    assert [s.request_id for s in scheduler.running] == ["b1", "i1"]
    assert step(scheduler) == {"b1": 1, "i1": 1}  # b2 waits for a free slot
    scheduler.finish(b1, "stop")
    assert step(scheduler) == {"i1": 1, "b2": 4}  # b2 recomputes its prompt and its one output token,
    assert step(scheduler) == {"i1": 1, "b2": 1}  # 4 tokens at most a step beside interactive work
    assert i1.status is SequenceStatus.RUNNING


def test_beside_interactive_decodes_batch_work_takes_a_few_tokens_decode_rows_first() -> None:
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64,
                          max_batch_tokens_beside_interactive=3)  # fmt: skip
    for name in ("b1", "b2"):
        add(scheduler, name, 4, "batch")
    assert step(scheduler) == {"b1": 4, "b2": 4}  # batch work alone: the whole budget
    add(scheduler, "i1", 4)
    assert step(scheduler) == {"i1": 4}
    add(scheduler, "b3", 9, "batch")
    assert step(scheduler) == {"i1": 1, "b1": 1, "b2": 1, "b3": 1}  # two decode rows, then one prompt token
    assert step(scheduler) == {"i1": 1, "b1": 1, "b2": 1, "b3": 1}
    scheduler.finish(next(s for s in scheduler.running if s.request_id == "i1"), "stop")
    assert step(scheduler) == {"b1": 1, "b2": 1, "b3": 7}  # interactive work gone: the rest of b3's prompt


def test_only_a_step_of_batch_work_alone_yields_to_interactive_requests() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "b1", 4, "batch")
    assert scheduler.schedule().yields_to_interactive
    add(scheduler, "i1", 4)
    assert not scheduler.schedule().yields_to_interactive  # i1's prefill
    assert not scheduler.schedule().yields_to_interactive  # i1's decode beside b1's
    assert not ScheduledBatch([], []).yields_to_interactive


def test_an_interactive_sequence_takes_the_kv_blocks_of_batch_sequences() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=8, max_num_batched_tokens=16)  # blocks of 4 tokens
    add(scheduler, "b1", 7, "batch")
    add(scheduler, "b2", 7, "batch")
    assert step(scheduler) == {"b1": 7, "b2": 7}  # all four blocks held
    add(scheduler, "i1", 6)
    assert step(scheduler) == {"i1": 6}
    assert [s.request_id for s in scheduler.waiting] == ["b2"] and scheduler.num_preempted_total == 1


def test_interactive_sequences_never_preempt_each_other_for_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "i1", 4)
    assert step(scheduler) == {"i1": 4}
    add(scheduler, "i2", 4)
    assert step(scheduler) == {"i1": 1}  # i2 waits its turn
    assert scheduler.num_preempted_total == 0


def test_under_memory_pressure_a_batch_sequence_goes_before_an_interactive_one() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=16)  # blocks of 4 tokens
    add(scheduler, "b1", 4, "batch")
    assert step(scheduler) == {"b1": 4}
    add(scheduler, "i1", 4)
    add(scheduler, "i2", 4)
    assert step(scheduler) == {"i1": 4, "i2": 4}  # b1 sits the interactive prefills out, keeping its block
    # i1 and i2 each need a new block for their next token: the batch sequence gives its up, although
    # it was admitted first (interactive decodes are scheduled first, so they are not its victims).
    assert step(scheduler) == {"i1": 1, "i2": 1}
    assert [s.request_id for s in scheduler.waiting] == ["b1"] and scheduler.num_preempted_total == 1


def test_the_queue_depth_is_counted_per_class() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "i1", 4)
    add(scheduler, "i2", 4)
    add(scheduler, "b1", 4, "batch")
    step(scheduler)
    assert (scheduler.waiting.count("interactive"), scheduler.waiting.count("batch")) == (1, 1)


def test_on_the_tiny_model_an_interactive_request_runs_at_once_and_every_output_is_unchanged(
    tiny_llama: TinyModel,
) -> None:
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = {f"b{i}": [10 * i + j for j in range(6)] for i in range(3)}
    prompts["i1"] = [7, 8, 9, 10, 11]

    def expected(name: str) -> list[int]:
        alone = make_engine(tiny_llama, enable_prefix_caching=False)
        alone.add_request(name, prompts[name], SamplingParams(**greedy))  # type: ignore[arg-type]
        return generated_ids(run_to_completion(alone)[name])

    engine: LLMEngine = make_engine(tiny_llama, max_num_seqs=3, enable_prefix_caching=False)
    for name in ("b0", "b1", "b2"):
        engine.add_request(name, prompts[name], SamplingParams(**greedy, priority="batch"))  # type: ignore[arg-type]
    first = engine.step()
    engine.add_request("i1", prompts["i1"], SamplingParams(**greedy))  # type: ignore[arg-type]
    second = engine.step()
    running = [seq.request_id for seq in engine.scheduler.running]
    assert running == ["b0", "b1", "i1"] and engine.stats().num_preempted_total == 1
    outputs: dict[str, list] = {}
    for output in [*first, *second]:
        outputs.setdefault(output.request_id, []).append(output)
    for name, rest in run_to_completion(engine).items():
        outputs.setdefault(name, []).extend(rest)
    assert {name: generated_ids(out) for name, out in outputs.items()} == {name: expected(name) for name in prompts}


def test_engine_stats_count_batch_sequences_waiting_and_running(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=2, enable_prefix_caching=False)
    batch = SamplingParams(max_tokens=4, priority="batch")
    for name in ("b0", "b1", "b2"):
        engine.add_request(name, [1, 2, 3], batch)
    engine.add_request("i0", [4, 5, 6], SamplingParams(max_tokens=4))
    engine.step()  # i0 is prefilled alone; the batch waits
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_waiting_batch, stats.num_running, stats.num_running_batch) == (3, 3, 1, 0)
    engine.step()  # i0 decodes and b0 takes the other slot; b1 and b2 wait
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_waiting_batch, stats.num_running, stats.num_running_batch) == (2, 2, 2, 1)


def test_a_step_of_batch_work_alone_is_given_up_between_layers_when_an_interactive_request_waits(
    tiny_llama: TinyModel,
) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, priority="batch")
    prompt = list(range(10, 30))
    plain = make_engine(tiny_llama, enable_prefix_caching=False)
    plain.add_request("b", prompt, greedy)
    expected = generated_ids(run_to_completion(plain)["b"])

    engine = make_engine(tiny_llama, enable_prefix_caching=False)
    engine.add_request("b", prompt, greedy)
    layers_run: list[int] = []
    for layer in engine.runner.model.layers:
        layer.register_forward_hook(lambda *_: layers_run.append(1))
    asked: list[int] = []
    engine.interactive_waiting = lambda: bool(asked.append(1)) or len(asked) > 1  # arrives during layer 0
    assert engine.step() == []
    seq = engine.scheduler.running[0]
    assert len(engine.runner.model.layers) > 1 and len(layers_run) == 1  # cut short after one layer
    assert (seq.num_computed_tokens, engine.stats().num_yielded_steps_total) == (0, 1)  # nothing recorded
    engine.interactive_waiting = None
    assert generated_ids(run_to_completion(engine)["b"]) == expected  # recomputed from scratch, same tokens


def test_a_step_with_interactive_work_in_it_is_never_given_up(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama, enable_prefix_caching=False)
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4, priority="batch"))
    engine.add_request("i", [4, 5, 6], SamplingParams(max_tokens=4))
    engine.interactive_waiting = lambda: True
    steps = [engine.step() for _ in range(3)]
    assert all(steps) and engine.stats().num_yielded_steps_total == 0
