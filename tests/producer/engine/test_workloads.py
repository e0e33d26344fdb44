"""Workloads: reproducible per seed, and sharing prefixes exactly the way each one promises."""

from __future__ import annotations

import itertools

import pytest

from hmakv.producer.engine.workloads import (
    WORKLOADS,
    AgenticWorkload,
    ArrivalSchedule,
    BurstWorkload,
    ChatWorkload,
    DocumentsWorkload,
    RandomPrefixWorkload,
    RequestSpec,
    UnknownWorkload,
    Workload,
    make_workload,
)

VOCAB = 512
CONTEXT = 1024


def answer(spec: RequestSpec) -> tuple[int, ...]:
    """A fixed stand-in for the model's output, so runs differ only by the workload's seed."""
    return tuple((len(spec.prompt_token_ids) * 31 + i) % VOCAB for i in range(spec.max_tokens))


def play(workload: Workload, count: int) -> list[RequestSpec]:
    """Ask for ``count`` requests, answering each as soon as it is asked."""
    specs = []
    for _ in range(count):
        spec = workload.next_request()
        assert spec is not None
        specs.append(spec)
        workload.finished(spec.request_id, answer(spec))
    return specs


@pytest.mark.parametrize("name", [n for n in WORKLOADS if n != "none"])
def test_same_seed_same_requests_other_seed_other_requests(name: str) -> None:
    def run(seed: int) -> list[RequestSpec]:
        return play(make_workload(name, seed=seed, vocab_size=VOCAB, context_tokens=CONTEXT), 60)

    first = run(1)
    assert first == run(1)
    assert [s.prompt_token_ids for s in first] != [s.prompt_token_ids for s in run(2)]
    assert all(0 <= t < VOCAB for s in first for t in s.prompt_token_ids)
    assert all(len(s.prompt_token_ids) <= CONTEXT and s.max_tokens >= 1 for s in first)
    assert len({s.request_id for s in first}) == len(first)


def test_chat_turns_extend_the_previous_turn_with_its_answer() -> None:
    workload = ChatWorkload(seed=3, vocab_size=VOCAB, context_tokens=CONTEXT)
    specs = play(workload, 200)
    by_id = {s.request_id: s for s in specs}

    follow_ups = 0
    for spec in specs:
        _, conversation, turn = spec.request_id.split("-")
        if turn == "0":
            assert any(spec.prompt_token_ids[: len(p)] == p for p in workload.system_prompts)
            continue
        previous = by_id[f"chat-{conversation}-{int(turn) - 1}"]
        history = previous.prompt_token_ids + answer(previous)
        assert spec.prompt_token_ids[: len(history)] == history
        assert len(spec.prompt_token_ids) > len(history)  # plus new user text
        follow_ups += 1
    assert follow_ups > 50
    assert max(int(s.request_id.split("-")[2]) for s in specs) <= 5  # at most max_turns


def test_chat_shares_a_few_system_prompts_across_conversations() -> None:
    workload = ChatWorkload(seed=4, vocab_size=VOCAB, context_tokens=CONTEXT)
    openers = [s for s in play(workload, 200) if s.request_id.endswith("-0")]
    used = {
        next(i for i, p in enumerate(workload.system_prompts) if s.prompt_token_ids[: len(p)] == p)
        for s in openers
    }
    assert len(openers) > 20
    assert used == set(range(len(workload.system_prompts)))


def test_chat_waits_for_answers_and_drops_aborted_conversations() -> None:
    workload = ChatWorkload(seed=5, vocab_size=VOCAB, context_tokens=CONTEXT)
    first = workload.next_request()
    second = workload.next_request()  # no answer yet: a new conversation starts
    assert first.request_id.split("-")[1] != second.request_id.split("-")[1]

    workload.finished(first.request_id, answer(first), completed=False)
    third = workload.next_request()
    assert third.request_id.endswith("-0"), "an aborted turn is not followed up"


def test_documents_are_shared_by_many_questions_most_by_the_first() -> None:
    workload = DocumentsWorkload(seed=6, vocab_size=VOCAB, context_tokens=CONTEXT)
    specs = play(workload, 300)

    counts = [0] * len(workload.documents)
    for spec in specs:
        (index,) = [
            i for i, d in enumerate(workload.documents) if spec.prompt_token_ids[: len(d)] == d
        ]
        counts[index] += 1
        assert len(spec.prompt_token_ids) > len(workload.documents[index])
    assert all(len(d) >= CONTEXT // 3 for d in workload.documents)
    assert counts[0] == max(counts) and min(counts) > 0


def test_random_prefix_prompts_cut_shared_prefixes_off_block_boundaries() -> None:
    workload = RandomPrefixWorkload(seed=7, vocab_size=VOCAB, context_tokens=CONTEXT)
    specs = play(workload, 300)

    shared = []
    for spec in specs:
        shared.append(max(_common_prefix(spec.prompt_token_ids, p) for p in workload.prefixes))
    assert sum(length >= 16 for length in shared) > 200
    assert sum(length % 16 != 0 for length in shared) > 200
    assert len({p for p in workload.prefixes}) == len(workload.prefixes)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def test_none_generates_nothing_and_unknown_names_are_listed() -> None:
    assert (
        make_workload("none", seed=0, vocab_size=VOCAB, context_tokens=CONTEXT).next_request()
        is None
    )
    with pytest.raises(
        UnknownWorkload, match="chat, agentic, documents, random-prefix, burst, none"
    ):
        make_workload("poetry", seed=0, vocab_size=VOCAB, context_tokens=CONTEXT)
    with pytest.raises(ValueError, match="context_tokens"):
        make_workload("chat", seed=0, vocab_size=VOCAB, context_tokens=10)


def arrivals_per_tick(schedule: ArrivalSchedule) -> list[int]:
    return [schedule.due(tick / 10) for tick in range(1, 1001)]  # 100 s in 0.1 s ticks


def test_arrivals_follow_the_rate_reproducibly_and_stop_at_the_duration() -> None:
    schedule = ArrivalSchedule(20.0, seed=8, duration=50.0)
    due = arrivals_per_tick(schedule)

    assert due == arrivals_per_tick(ArrivalSchedule(20.0, seed=8, duration=50.0))
    assert due != arrivals_per_tick(ArrivalSchedule(20.0, seed=9, duration=50.0))
    assert 900 <= sum(due) <= 1100  # 20/s over 50 s
    assert sum(due[500:]) == 0
    assert schedule.next_arrival is None


def test_arrivals_without_duration_continue_and_a_rate_must_be_positive() -> None:
    schedule = ArrivalSchedule(5.0, seed=1)
    schedule.due(1000.0)
    next_arrival = schedule.next_arrival
    assert next_arrival is not None and next_arrival > 1000.0
    with pytest.raises(ValueError, match="rate"):
        ArrivalSchedule(0.0, seed=1)


def test_agentic_steps_append_long_tool_outputs_to_a_long_shared_prompt() -> None:
    workload = AgenticWorkload(seed=6, vocab_size=VOCAB, context_tokens=CONTEXT)
    specs = play(workload, 200)
    by_id = {s.request_id: s for s in specs}
    assert all(len(p) >= CONTEXT // 4 for p in workload.system_prompts)
    appended = []
    for spec in specs:
        _, session, step = spec.request_id.split("-")
        if step == "0":
            continue
        previous = by_id[f"agentic-{session}-{int(step) - 1}"]
        history = previous.prompt_token_ids + answer(previous)
        assert spec.prompt_token_ids[: len(history)] == history
        appended.append(len(spec.prompt_token_ids) - len(history))
    assert len(appended) > 50
    assert max(appended) > CONTEXT // 16  # tool outputs longer than chat's user turns


def test_a_burst_shares_one_new_prefix_and_the_next_burst_another() -> None:
    workload = BurstWorkload(seed=7, vocab_size=VOCAB, context_tokens=CONTEXT, burst_size=4)
    specs = play(workload, 12)
    bursts = [specs[i : i + 4] for i in range(0, 12, 4)]
    prefixes = []
    for burst in bursts:
        shared = min(
            _common_prefix(burst[0].prompt_token_ids, s.prompt_token_ids) for s in burst[1:]
        )
        assert shared >= CONTEXT // 2
        prefixes.append(burst[0].prompt_token_ids[:shared])
    assert _common_prefix(prefixes[0], prefixes[1]) < 8  # a new document each burst
    assert [s.request_id for s in bursts[1]] == [f"burst-1-{m}" for m in range(4)]


def test_bursty_arrivals_come_in_groups_at_the_same_mean_rate() -> None:
    schedule = ArrivalSchedule(20.0, seed=3, duration=400.0, burst_size=5, burst_spacing=0.002)
    times = []
    while (at := schedule.next_arrival) is not None:
        times.extend([at] * schedule.due(at))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    within = [gap for index, gap in enumerate(gaps) if (index + 1) % 5]
    assert 7000 < len(times) < 9000  # 20/s for 400 s
    assert sum(within) / len(within) < 0.004
    assert times == sorted(times)


def test_one_request_bursts_are_the_plain_poisson_schedule() -> None:
    plain = ArrivalSchedule(5.0, seed=9, duration=50.0)
    single = ArrivalSchedule(5.0, seed=9, duration=50.0, burst_size=1)
    assert [plain.due(t / 10) for t in range(500)] == [single.due(t / 10) for t in range(500)]
