"""The reference model's paged cache: what it writes where, and that reading it back is exact.

Prefix caching is only correct if continuing from cached blocks gives what computing from scratch
gives; these tests check that for every group kind, with block tables laid out the way vLLM's
cache manager lays them out (scattered block ids, the null block where a group skipped blocks).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch

from hmakv.producer.engine.cache_manager import HybridCacheManager
from hmakv.producer.engine.hit_rule import (
    UnsupportedGroup,
    alignment_tokens,
    required_blocks,
)
from hmakv.producer.engine.model import (
    AttentionMixer,
    HybridModel,
    MambaMixer,
    SequenceStep,
    default_device,
    layer_groups,
)
from hmakv.producer.engine.paged_attention import NULL_BLOCK, BlockTableError, visible_mask
from hmakv.producer.engine.profiles import ModelDims, ModelProfile, get_profile
from hmakv.producer.events import MAMBA_KIND, GroupSpec
from hmakv.producer.recorder import EventRecorder

FULL = GroupSpec(kind="full_attention", block_size=4)
WINDOW = 6
SLIDING = GroupSpec(kind="sliding_window", block_size=4, sliding_window=WINDOW)
CHUNKED = GroupSpec(kind="chunked_local_attention", block_size=4, chunk_size=8)
MAMBA = GroupSpec(kind="mamba", block_size=8)
VOCAB = 300
NUM_BLOCKS = 128
ATOL = 1e-5
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def make_profile(groups: Sequence[GroupSpec], layers: Sequence[int]) -> ModelProfile:
    return ModelProfile(
        name="test",
        groups=tuple(groups),
        num_blocks=NUM_BLOCKS,
        dims=ModelDims(layers_per_group=tuple(layers), num_heads=2, head_dim=8, vocab_size=VOCAB),
    )


HYBRID = make_profile([FULL, SLIDING, MAMBA], [1, 2, 1])
PROFILES = {
    "full+sliding": make_profile([FULL, SLIDING], [1, 1]),
    "full+chunked": make_profile([FULL, CHUNKED], [1, 1]),
    "full+sliding+mamba": HYBRID,
}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The model's tensors are tiny: parallel kernels only add spin-waits on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokens(count: int, seed: int) -> list[int]:
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count,), generator=rng).tolist()


class Pool:
    """Hands out distinct, deliberately non-contiguous block ids, never the null block."""

    def __init__(self) -> None:
        # A step coprime with the pool size visits every block but the null one, out of order.
        self._ids: Iterator[int] = iter(
            (NULL_BLOCK + 1 + i * 37 % (NUM_BLOCKS - 1)) for i in range(NUM_BLOCKS - 1)
        )

    def table(self, spec: GroupSpec, num_tokens: int) -> list[int]:
        return [next(self._ids) for _ in range(-(-num_tokens // spec.block_size))]

    def tables(self, profile: ModelProfile, num_tokens: int) -> list[list[int]]:
        return [self.table(spec, num_tokens) for spec in profile.groups]


def model_for(profile: ModelProfile, device: str = "cpu") -> HybridModel:
    return HybridModel(profile, seed=7, device=device, num_blocks=NUM_BLOCKS)


def prefill_in_parts(
    model: HybridModel, prompt: Sequence[int], cuts: Sequence[int], tables: list[list[int]]
) -> torch.Tensor:
    bounds = [0, *cuts, len(prompt)]
    for start, end in itertools.pairwise(bounds):
        out = model.prefill("r", prompt[start:end], start, tables)
    return out.logits


def poison(model: HybridModel, group: int, blocks: Sequence[int]) -> None:
    tensor = model.cache.tensors[group]
    index = torch.tensor(list(blocks), dtype=torch.long)
    if model.profile.groups[group].kind == MAMBA_KIND:
        tensor[:, index] = float("nan")
    else:
        tensor[:, :, index] = float("nan")


def test_a_batched_step_gives_each_request_its_own_logits() -> None:
    model = model_for(HYBRID)
    pool = Pool()
    batch = [
        SequenceStep("a", tokens(9, seed=1), 0, pool.tables(HYBRID, 9)),
        SequenceStep("b", tokens(3, seed=2), 0, pool.tables(HYBRID, 3)),
    ]
    outputs = model.step(batch)
    assert [out.request_id for out in outputs] == ["a", "b"]
    for seq, out in zip(batch, outputs, strict=True):
        assert out.logits.shape == (VOCAB,)
        assert torch.isfinite(out.logits).all()
        assert out.next_token == int(out.logits.argmax())
        alone = model_for(HYBRID).prefill("alone", seq.token_ids, 0, seq.block_tables)
        torch.testing.assert_close(out.logits, alone.logits, rtol=0, atol=ATOL)


def visible_keys(spec: GroupSpec, query: int) -> list[int]:
    mask = visible_mask(spec, torch.tensor([query]), torch.arange(query + 3))
    return mask[0].nonzero().flatten().tolist()


def test_what_each_group_kind_lets_a_query_see() -> None:
    assert visible_keys(FULL, 10) == list(range(11))
    # vLLM / Hugging Face: a window of W is the W tokens ending at the query, itself included.
    assert visible_keys(SLIDING, 10) == [5, 6, 7, 8, 9, 10]
    assert visible_keys(CHUNKED, 10) == [8, 9, 10]


def test_layers_interleave_like_the_real_models() -> None:
    assert layer_groups(get_profile("gpt-oss-like")) == (1, 0, 1, 0)
    assert layer_groups(get_profile("gemma3-like")) == (1, 2, 3, 4, 5, 0)
    assert layer_groups(HYBRID) == (1, 2, 0, 1)


def test_cache_tensors_have_the_documented_layout() -> None:
    model = model_for(HYBRID)
    full, sliding, mamba = model.cache.tensors
    assert full.shape == (1, 2, NUM_BLOCKS, 4, 2, 8)
    assert sliding.shape == (2, 2, NUM_BLOCKS, 4, 2, 8)
    assert mamba.shape == (1, NUM_BLOCKS, 16)


def test_written_kv_is_the_layer_projection_at_the_table_slots() -> None:
    profile = make_profile([FULL], [2])
    model = model_for(profile)
    prompt = tokens(10, seed=3)
    table = [41, 7, 23]
    model.prefill("r", prompt, 0, [table])

    first = model.layers[0]
    assert isinstance(first.mixer, AttentionMixer)
    key, value = first.mixer.project_kv(first.normed(model.embed(prompt)), torch.arange(10))
    cache = model.cache.tensors[0][first.slot]
    for position in range(10):
        block, slot = table[position // 4], position % 4
        torch.testing.assert_close(cache[0, block, slot], key[position], rtol=0, atol=0)
        torch.testing.assert_close(cache[1, block, slot], value[position], rtol=0, atol=0)
    untouched = [b for b in range(NUM_BLOCKS) if b not in table]
    assert not model.cache.tensors[0][:, :, untouched].any()


def test_mamba_blocks_hold_the_state_at_their_last_token() -> None:
    profile = make_profile([GroupSpec(kind="mamba", block_size=4)], [1])
    model = model_for(profile)
    prompt = tokens(10, seed=4)
    # Like vLLM's align mode: the middle block was never allocated (null), the others were.
    table = [5, NULL_BLOCK, 8]
    model.prefill("r", prompt, 0, [table])

    layer = model.layers[0]
    assert isinstance(layer.mixer, MambaMixer)
    states = layer.mixer.states(layer.normed(model.embed(prompt)), torch.zeros(16))
    cache = model.cache.tensors[0][0]
    torch.testing.assert_close(cache[5], states[3])  # end of block 0: 4 tokens in
    torch.testing.assert_close(cache[8], states[9])  # the live state after the last token
    assert not cache[NULL_BLOCK].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_prefill_in_parts_equals_prefill_at_once(name: str, device: str) -> None:
    profile = PROFILES[name]
    prompt = tokens(23, seed=5)
    whole = model_for(profile, device)
    at_once = whole.prefill("r", prompt, 0, Pool().tables(profile, 23)).logits
    # Cuts on and off block boundaries, one inside a mamba block, one a single token long.
    parts = prefill_in_parts(
        model_for(profile, device), prompt, [5, 16, 17], Pool().tables(profile, 23)
    )
    torch.testing.assert_close(parts, at_once, rtol=0, atol=ATOL)


def hit_tables(
    profile: ModelProfile, cached: list[list[int]], hit_tokens: int, total: int, pool: Pool
) -> list[list[int]]:
    """What the cache manager gives a request hitting ``hit_tokens``: the cached blocks the hit
    rule requires, the null block for the ones it skips, then fresh blocks."""
    tables = []
    for spec, table in zip(profile.groups, cached, strict=True):
        hit_blocks = hit_tokens // spec.block_size
        needed = required_blocks(spec, hit_tokens)
        row = [table[i] if i in needed else NULL_BLOCK for i in range(hit_blocks)]
        tables.append(row + pool.table(spec, total)[hit_blocks:])
    return tables


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_prefix_hit_reads_only_the_required_blocks_and_matches_a_recompute(name: str) -> None:
    profile = PROFILES[name]
    prefix, total = 3 * alignment_tokens(profile.groups), 31
    first_prompt = tokens(prefix, seed=6) + tokens(total - prefix, seed=7)
    second_prompt = first_prompt[:prefix] + tokens(total - prefix, seed=8)
    scratch = model_for(profile).prefill("s", second_prompt, 0, Pool().tables(profile, total))

    model = model_for(profile)
    pool = Pool()
    first_tables = pool.tables(profile, total)
    model.prefill("first", first_prompt, 0, first_tables)
    tables = hit_tables(profile, first_tables, prefix, total, pool)
    # Whatever the hit does not need may already be freed and reused: make reading it show.
    for group, (cached, reused) in enumerate(zip(first_tables, tables, strict=True)):
        poison(model, group, [b for b in cached if b not in reused] + [NULL_BLOCK])
    hit = model.prefill("second", second_prompt[prefix:], prefix, tables)

    assert torch.isfinite(hit.logits).all()
    torch.testing.assert_close(hit.logits, scratch.logits, rtol=0, atol=ATOL)


def test_a_hit_on_blocks_of_another_prefix_changes_the_output() -> None:
    """The equivalence above is not vacuous: the cached K/V and state decide the logits."""
    profile = HYBRID
    prefix, total = 16, 20
    prompt = tokens(total, seed=9)
    scratch = model_for(profile).prefill("s", prompt, 0, Pool().tables(profile, total))
    model = model_for(profile)
    pool = Pool()
    other_tables = pool.tables(profile, total)
    model.prefill("other", tokens(prefix, seed=10), 0, other_tables)
    wrong = model.prefill(
        "r", prompt[prefix:], prefix, hit_tables(profile, other_tables, prefix, total, pool)
    )
    assert (wrong.logits - scratch.logits).abs().max() > 1e-2


def test_decode_batch_continues_like_a_full_recompute() -> None:
    model = model_for(HYBRID)
    pool = Pool()
    prompts = {"a": tokens(13, seed=11), "b": tokens(6, seed=12)}
    tables = {rid: pool.tables(HYBRID, 40) for rid in prompts}
    sequences = {rid: list(p) for rid, p in prompts.items()}
    next_tokens = {
        rid: model.prefill(rid, p, 0, tables[rid]).next_token for rid, p in prompts.items()
    }
    for _ in range(10):
        batch = [
            SequenceStep(rid, [next_tokens[rid]], len(seq), tables[rid])
            for rid, seq in sequences.items()
        ]
        for seq_step, out in zip(batch, model.decode(batch), strict=True):
            sequences[seq_step.request_id].append(next_tokens[seq_step.request_id])
            full = sequences[seq_step.request_id]
            recompute = model_for(HYBRID).prefill("x", full, 0, Pool().tables(HYBRID, 40))
            torch.testing.assert_close(out.logits, recompute.logits, rtol=0, atol=ATOL)
            next_tokens[seq_step.request_id] = out.next_token


def test_sliding_window_decode_never_reads_blocks_it_has_left() -> None:
    profile = make_profile([SLIDING], [2])
    prompt = tokens(9, seed=13)
    reference, model = model_for(profile), model_for(profile)
    table = Pool().table(SLIDING, 40)
    live = list(table)
    ref_next = reference.prefill("r", prompt, 0, [table]).next_token
    next_token = model.prefill("r", prompt, 0, [live]).next_token
    for position in range(len(prompt), 30):
        # The cache manager frees a block once all its tokens are out of the window.
        first_visible = position - WINDOW + 1
        for index in range(first_visible // SLIDING.block_size):
            if live[index] != NULL_BLOCK:
                poison(model, 0, [live[index]])
                live[index] = NULL_BLOCK
        poison(model, 0, [NULL_BLOCK])
        expected = reference.decode([SequenceStep("r", [ref_next], position, [table])])[0]
        out = model.decode([SequenceStep("r", [next_token], position, [live])])[0]
        assert torch.isfinite(out.logits).all()
        torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=0)
        ref_next, next_token = expected.next_token, out.next_token
    assert live.count(NULL_BLOCK) == 6


def test_a_block_missing_inside_the_window_is_an_error() -> None:
    model = model_for(make_profile([SLIDING], [1]))
    table = Pool().table(SLIDING, 12)
    model.prefill("r", tokens(8, seed=14), 0, [table])
    # Position 8 sees positions 3..8: block 0 (positions 0..3) must still be there.
    with pytest.raises(BlockTableError, match="read position 3"):
        model.prefill("r", [1], 8, [[NULL_BLOCK, *table[1:]]])


def test_malformed_steps_are_refused() -> None:
    model = model_for(HYBRID)
    tables = Pool().tables(HYBRID, 8)
    with pytest.raises(ValueError, match="block tables"):
        model.prefill("r", [1, 2], 0, tables[:2])
    with pytest.raises(ValueError, match="one token per request"):
        model.decode([SequenceStep("r", [1, 2], 0, tables)])
    with pytest.raises(ValueError, match="vocabulary"):
        model.prefill("r", [VOCAB], 0, tables)
    with pytest.raises(UnsupportedGroup):
        model_for(make_profile([GroupSpec(kind="cross_attention", block_size=4)], [1]))


def test_the_seed_decides_the_weights() -> None:
    prompt = tokens(6, seed=15)
    tables = Pool().tables(HYBRID, 6)

    def logits(seed: int) -> torch.Tensor:
        model = HybridModel(HYBRID, seed=seed, device="cpu", num_blocks=NUM_BLOCKS)
        return model.prefill("r", prompt, 0, tables).logits

    assert torch.equal(logits(1), logits(1))
    assert not torch.equal(logits(1), logits(2))


def test_the_accelerator_is_chosen_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
    model = HybridModel(HYBRID, num_blocks=NUM_BLOCKS)
    assert model.device == torch.device("cpu")
    assert all(t.device.type == "cpu" for t in model.cache.tensors)


def serve(
    manager: HybridCacheManager, model: HybridModel, request_id: str, prompt: list[int]
) -> tuple[int, list[int], torch.Tensor]:
    """Prefill in 64-token chunks and decode a few tokens, on the manager's block tables; returns
    the prefix hit, the whole sequence and the logits after its last token."""
    admission = manager.admit(request_id, prompt, token_budget=64)
    assert admission is not None
    sequence, start, count = (
        list(prompt),
        admission.num_cached_tokens,
        admission.num_scheduled_tokens,
    )
    while True:
        step = SequenceStep(
            request_id, sequence[start : start + count], start, manager.block_table(request_id)
        )
        out = model.step([step])[0]
        manager.end_step()
        start += count
        if start == len(sequence):
            if len(sequence) == len(prompt) + 5:
                manager.finish(request_id)
                return admission.num_cached_tokens, sequence, out.logits
            sequence.append(out.next_token)
            manager.append_tokens(request_id, [out.next_token])
        scheduled = manager.schedule(request_id, token_budget=64)
        assert scheduled
        count = scheduled


@pytest.mark.parametrize("name", ["gpt-oss-like", "swa-small", "mamba-hybrid-like"])
def test_serving_on_the_cache_managers_tables_matches_a_recompute(name: str) -> None:
    """End to end with the engine's own cache manager: its hits, freed sliding-window blocks
    and mamba state blocks give exactly what recomputing every token gives."""
    profile = get_profile(name)
    manager = HybridCacheManager(profile, EventRecorder(profile.groups))
    model = HybridModel(profile, seed=7, device="cpu")
    shared = tokens(300, seed=16)
    serve(manager, model, "first", shared + tokens(40, seed=17))
    hit, sequence, logits = serve(manager, model, "second", shared + tokens(40, seed=18))

    assert hit >= 256
    scratch = HybridModel(profile, seed=7, device="cpu")
    tables = [list(range(1, 1 + -(-len(sequence) // spec.block_size))) for spec in profile.groups]
    expected = scratch.prefill("scratch", sequence, 0, tables).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
