from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, apply_penalties, make_generator, sampling_probs
from engine.sampling_params import SamplingParams

torch.set_num_threads(1)

EOS = 3


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float32).log()


def _sample(logits, params, prompts=None, outputs=None, generators=None, eos=(EOS,)):
    n = logits.shape[0]
    return Sampler(eos_token_ids=eos).sample(
        logits,
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators,
    )


def test_top_k_keeps_exactly_the_k_largest_logits():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = sampling_probs(logits, [SamplingParams(top_k=2)])
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.softmax(torch.tensor([5.0, 4.0]), dim=0)
    torch.testing.assert_close(probs[0], expected, rtol=0, atol=1e-7)


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    logits = torch.tensor([[1.0, 5.0, 3.0]])
    probs = sampling_probs(logits, [SamplingParams(top_k=50)])
    torch.testing.assert_close(probs[0], torch.softmax(logits[0], dim=0))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.7, [0, 1]), (0.85, [0, 1, 2]), (0.4, [0]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_head_reaching_p(top_p, kept):
    base = [0.5, 0.3, 0.15, 0.05]
    probs = sampling_probs(_log(base), [SamplingParams(top_p=top_p)])
    mass = sum(base[i] for i in kept)
    expected = torch.tensor([base[i] / mass if i in kept else 0.0 for i in range(4)])
    torch.testing.assert_close(probs[0], expected, rtol=0, atol=1e-6)


def _sorted_top_p_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's apply_top_k_top_p for top_p alone: one ascending sort over the whole vocabulary."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    mask = logits_sort.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    mask[:, -1] = False
    logits_sort.masked_fill_(mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat (full-sort path) to peaked (candidates)
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_keeps_the_same_tokens_as_a_full_sort(scale, top_p):
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(3)) * scale
    probs = sampling_probs(logits, [SamplingParams(top_p=top_p)] * 4)
    expected = _sorted_top_p_reference(logits, top_p)
    assert torch.equal(probs > 0, expected > float("-inf"))
    torch.testing.assert_close(probs, torch.softmax(expected, dim=-1), rtol=0, atol=1e-6)


def test_top_k_then_top_p_renormalizes_within_the_top_k():
    base = [0.4, 0.3, 0.2, 0.1]
    # top_k=3 leaves [4/9, 3/9, 2/9]; top_p=0.6 then keeps the first two (mass above: 0, 4/9).
    probs = sampling_probs(_log(base), [SamplingParams(top_k=3, top_p=0.6)])
    torch.testing.assert_close(probs[0], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), rtol=0, atol=1e-6)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    base = [0.5, 0.3, 0.15, 0.05]
    probs = sampling_probs(_log(base), [SamplingParams(min_p=0.2)])  # threshold 0.1
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    torch.testing.assert_close(probs[0], expected, rtol=0, atol=1e-6)


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    probs = sampling_probs(logits, [SamplingParams(temperature=0.5)])
    torch.testing.assert_close(probs[0], torch.softmax(logits[0] / 0.5, dim=0))


def test_each_row_gets_its_own_filters_in_one_batch():
    base = [0.5, 0.3, 0.15, 0.05]
    logits = _log(base).repeat(3, 1)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.7), SamplingParams()]
    probs = sampling_probs(logits, params)
    torch.testing.assert_close(probs[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(probs[2], torch.tensor(base), rtol=0, atol=1e-6)


def test_sampled_tokens_never_leave_the_top_k_top_p_set():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]]).repeat(2000, 1)
    out = _sample(logits, [SamplingParams(top_k=3, top_p=0.9)] * 2000)
    assert set(out.token_ids) <= {1, 2, 3}


def test_empirical_frequencies_match_the_distribution():
    torch.manual_seed(0)
    base = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    num = 20000
    out = _sample(base.log().repeat(num, 1), [SamplingParams(temperature=1.0)] * num, eos=())
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / num
    # 4 sigma of a binomial proportion at p=0.5 over 20000 draws is 0.014.
    assert (freq - base).abs().max().item() < 0.014


def test_greedy_rows_take_the_argmax_whatever_the_other_filters():
    logits = torch.tensor([[0.1, 0.9, 0.3, 0.2], [2.0, 1.0, 1.0, 0.5]])
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5), SamplingParams(temperature=0.0)]
    for _ in range(5):
        assert _sample(logits, params, eos=()).token_ids == [1, 0]


def test_penalties_change_logits_exactly_as_vllm_defines():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.5)]
    out = apply_penalties(logits.clone(), params, prompt_token_ids=[[0]], output_token_ids=[[1, 3, 3]])
    # Token 0 (prompt only): 2 / 2. Token 1 (output once): -1 * 2 - 0.1 - 0.5.
    # Token 3 (output twice): 3 / 2 - 0.2 - 0.5. Tokens 2 and 4 unseen: unchanged.
    torch.testing.assert_close(out[0], torch.tensor([1.0, -2.6, 0.5, 0.8, 0.0]), rtol=0, atol=1e-6)


def _dense_penalties(logits, params, prompts, outputs):
    """vLLM's apply_penalties over (num_seqs, vocab) masks, as the reference."""
    num_seqs, vocab = logits.shape
    counts = torch.zeros(num_seqs, vocab)
    prompt_mask = torch.zeros(num_seqs, vocab, dtype=torch.bool)
    for i in range(num_seqs):
        for t in outputs[i]:
            counts[i, t] += 1
        prompt_mask[i, list(prompts[i])] = True
    rep = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1).repeat(1, vocab)
    rep[~(prompt_mask | (counts > 0))] = 1.0
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits -= torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1) * counts
    logits -= torch.tensor([p.presence_penalty for p in params]).unsqueeze(1) * (counts > 0)
    return logits


@pytest.mark.parametrize("seed", range(5))
def test_sparse_penalties_equal_vllms_dense_formula(seed):
    rng = torch.Generator().manual_seed(seed)
    vocab, num_seqs = 50, 6
    logits = torch.randn(num_seqs, vocab, generator=rng) * 3
    lengths = torch.randint(0, 40, (2, num_seqs), generator=rng).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in lengths[0]]
    outputs = [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in lengths[1]]
    outputs[0] = []  # a row with nothing generated yet, but penalties set
    params = [
        SamplingParams(
            repetition_penalty=[1.0, 0.7, 1.3, 2.0][i % 4],
            frequency_penalty=[0.0, 0.4, -1.0][i % 3],
            presence_penalty=[0.0, -0.5, 1.5][(i + 1) % 3],
        )
        for i in range(num_seqs)
    ]
    got = apply_penalties(logits.clone(), params, prompts, outputs)
    torch.testing.assert_close(got, _dense_penalties(logits, params, prompts, outputs), rtol=0, atol=1e-5)


def test_penalties_apply_per_row_and_padding_touches_nothing():
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    params = [SamplingParams(presence_penalty=1.0), SamplingParams()]
    out = apply_penalties(logits.clone(), params, [[], []], [[2, 2, 2, 2], []])
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))


def test_a_repetition_penalty_moves_greedy_off_a_repeated_token():
    logits = torch.tensor([[1.0, 2.0, 1.5]])
    assert _sample(logits, [SamplingParams(temperature=0)], outputs=[[1]], eos=()).token_ids == [1]
    penalized = [SamplingParams(temperature=0, repetition_penalty=1.5)]
    assert _sample(logits, penalized, outputs=[[1]], eos=()).token_ids == [2]


def test_a_repetition_penalty_too_small_for_float32_keeps_masked_tokens_masked():
    # Found by the API fuzzer: 5e-324 is 0 in float32, and a grammar's -inf times 0 was nan, which
    # argmax picked: the output left its grammar.
    logits = torch.tensor([[float("-inf"), 1.0, -2.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=5e-324)]

    out = apply_penalties(logits.clone(), params, [[0, 1, 2]], [[]])

    assert not out.isnan().any() and out[0, 0] == float("-inf")
    assert _sample(logits, params, prompts=[[0, 1, 2]], outputs=[[]], eos=()).token_ids == [1]


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 10.0]])  # EOS (3) first, stop id 2 second
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])]
    assert _sample(logits, params, outputs=[[]]).token_ids == [1]
    assert _sample(logits, params, outputs=[[1]]).token_ids == [1]
    assert _sample(logits, params, outputs=[[1, 1]]).token_ids == [EOS]


def test_min_tokens_leaves_an_ignored_eos_alone():
    logits = torch.tensor([[0.0, 1.0, 9.0, 10.0]])
    params = [SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)]
    assert _sample(logits, params, outputs=[[]]).token_ids == [EOS]


def test_eos_ids_given_to_sample_override_the_constructor():
    logits = torch.tensor([[0.0, 1.0, 9.0, 10.0]])
    params = [SamplingParams(temperature=0, min_tokens=1)]
    out = Sampler(eos_token_ids=[3]).sample(logits, params, [[]], [[]], [None], eos_token_ids=[2])
    assert out.token_ids == [3]


def _seeded_run(seed: int, steps: int, logits_seq, layout) -> list[int]:
    """Sample `steps` tokens for one seeded row; `layout(step)` gives (batch size, row position)."""
    params = SamplingParams(seed=seed, temperature=0.8, top_k=50, top_p=0.95)
    gen = make_generator(seed, "cpu")
    others = [make_generator(99, "cpu"), None, make_generator(7, "cpu")]
    tokens: list[int] = []
    for step in range(steps):
        size, pos = layout(step)
        logits = torch.randn(size, logits_seq.shape[1])  # other rows: fresh noise each step
        logits[pos] = logits_seq[step]
        all_params = [SamplingParams(temperature=1.0)] * size
        all_params[pos] = params
        gens = [others[i % 3] for i in range(size)]
        gens[pos] = gen
        # A greedy row in the mix too, when there is room.
        if size > 1:
            g = (pos + 1) % size
            all_params[g], gens[g] = SamplingParams(temperature=0.0), None
        out = _sample(logits, all_params, generators=gens, eos=())
        tokens.append(out.token_ids[pos])
    return tokens


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    torch.manual_seed(1)
    steps, vocab = 40, 300
    logits_seq = torch.randn(steps, vocab) * 2
    alone = _seeded_run(1234, steps, logits_seq, lambda s: (1, 0))
    batched = _seeded_run(1234, steps, logits_seq, lambda s: (5, 3))
    moving = _seeded_run(1234, steps, logits_seq, lambda s: (2 + s % 6, s % (2 + s % 6)))
    assert alone == batched == moving
    assert alone != _seeded_run(4321, steps, logits_seq, lambda s: (1, 0))


def test_unseeded_rows_do_not_consume_a_seeded_rows_randomness():
    gen_a, gen_b = make_generator(5, "cpu"), make_generator(5, "cpu")
    logits = torch.zeros(3, 1000)
    params = [SamplingParams(seed=5), SamplingParams(), SamplingParams()]
    first = _sample(logits, params, generators=[gen_a, None, None], eos=()).token_ids[0]
    _sample(logits[:1], params[:1], generators=[gen_b], eos=())
    assert gen_a.get_state().equal(gen_b.get_state())
    assert isinstance(first, int)


def test_make_generator_is_none_without_a_seed_and_accepts_any_int():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(-1, "cpu"), make_generator(2**64 - 1, "cpu")
    assert a.initial_seed() == b.initial_seed() == 2**64 - 1


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top_entries():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0.3, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(),
    ]
    out = _sample(logits, params, outputs=[[1, 2], [], []], eos=())
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for row in (0, 1):
        lp = out.logprobs[row]
        tok = out.token_ids[row]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[row, tok].item(), abs=1e-6)
        assert lp.rank == int((raw[row] > raw[row, tok]).sum()) + 1
    assert out.logprobs[1].top_logprobs == [] and out.logprobs[1].rank == 1
    top = out.logprobs[0].top_logprobs
    vals, ids = raw[0].topk(5)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-6)


def test_twenty_top_logprobs_and_half_precision_logits():
    logits = torch.randn(2, 64).to(torch.bfloat16)
    params = [SamplingParams(logprobs=20), SamplingParams(temperature=0, logprobs=1)]
    out = _sample(logits, params, eos=())
    assert len(out.logprobs[0].top_logprobs) == 20
    assert len(out.logprobs[1].top_logprobs) == 1
    assert out.logprobs[1].top_logprobs[0][0] == out.token_ids[1]
    total = sum(math.exp(v) for _, v in out.logprobs[0].top_logprobs)
    assert 0.0 < total <= 1.0 + 1e-6


def test_the_callers_logits_are_left_untouched():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, min_tokens=1, repetition_penalty=2.0, top_k=2)]
    _sample(logits, params, prompts=[[0, 1]])
    assert torch.equal(logits, before)


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_matches_itself_across_batches():
    logits = torch.randn(4, 1000, device="cuda")
    params = [SamplingParams(seed=3, top_p=0.9)] + [SamplingParams()] * 3
    alone = _sample(logits[:1], params[:1], generators=[make_generator(3, "cuda")], eos=())
    mixed = _sample(logits, params, generators=[make_generator(3, "cuda"), None, None, None], eos=())
    assert alone.token_ids[0] == mixed.token_ids[0]
