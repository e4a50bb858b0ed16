"""The temperature / top-k / top-p transform shared by target and draft."""

import pytest
import torch

from specadapt.sampling import SamplingParams, logits_to_probs


def test_greedy_is_one_hot_on_the_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_softmax():
    logits = torch.randn(3, 10)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_tokens():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False, False]
    assert float(probs.sum()) == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # top_p 0.79: {0.5, 0.3} reaches it; 0.81: the third token is needed. (Not exactly 0.8: 0.5 + 0.3 == 0.8 is a
    # float tie that the vectorised exp of each instruction set may round to either side.)
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.79))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert (probs[0] > 0).tolist() == [True, True, True, False]
    # top_p below the largest probability still keeps one token
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.1))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs,needle",
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k")],
)
def test_bad_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-39, 1e-38, 1e-20, 5e-7])
def test_temperatures_below_the_greedy_threshold_are_greedy(temperature):
    """Issue 19.6: logits / T overflowed to inf for T <= ~1e-38 (NaN probabilities); below GREEDY_TEMPERATURE
    (1e-6, SGLang's rule) the transform is greedy: one-hot on the first argmax, finite."""
    from specadapt.sampling import GREEDY_TEMPERATURE

    assert temperature < GREEDY_TEMPERATURE
    params = SamplingParams(temperature, top_p=0.9, top_k=3)
    assert params.greedy and params.temperature == 0.0
    logits = torch.tensor([[10.0, 30.0, 30.0, -5.0], [3e4, -3e4, 0.0, 1.0]])
    probs = logits_to_probs(logits, params)
    assert torch.equal(probs, logits_to_probs(logits, SamplingParams(0.0)))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_at_the_threshold_samples():
    from specadapt.sampling import GREEDY_TEMPERATURE

    params = SamplingParams(GREEDY_TEMPERATURE)
    assert not params.greedy
    probs = logits_to_probs(torch.tensor([[1.0, 1.0 + 1e-6, -2.0]]), params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(1))


def test_per_row_settings_give_each_row_exactly_its_own_transform():
    """logits_to_probs_rows (continuous batching): every row equals logits_to_probs of that row alone with its
    settings, bit for bit, with shared penalties (per-row histories) and a reduced vocabulary; a settings list of
    the wrong length is refused."""
    from specadapt.sampling import TokenCounts, logits_to_probs_rows

    torch.manual_seed(0)
    logits = torch.randn(5, 3, 40) * 3
    pen = dict(repetition_penalty=1.3, frequency_penalty=0.4)
    params = [SamplingParams(1.0, 0.9, **pen), SamplingParams(0.0, **pen), SamplingParams(1.0, 0.9, **pen),
              SamplingParams(1.5, 1.0, 5, min_p=0.1, **pen), SamplingParams(0.7, 0.5, **pen)]
    history = TokenCounts.from_sequences([[1, 2, 2, 7], [3], [5, 5, 5, 6, 1], [9, 8], [0, 0]], [2, 1, 1, 2, 1], 40)
    history = history[torch.arange(5)[:, None].expand(5, 3)]  # the same counts at every slot of a row
    for vocab_ids in (None, torch.arange(0, 40, 2)):
        rows = logits if vocab_ids is None else logits[..., vocab_ids]
        got = logits_to_probs_rows(rows, params, history, vocab_ids=vocab_ids)
        for r, p in enumerate(params):
            alone = logits_to_probs(rows[r:r + 1], p, history[r:r + 1], vocab_ids=vocab_ids)
            assert torch.equal(got[r:r + 1], alone), r
    assert torch.equal(logits_to_probs_rows(logits, params[0], history), logits_to_probs(logits, params[0], history))
    with pytest.raises(ValueError, match="4 settings for 5 rows"):
        logits_to_probs_rows(logits, params[:4], history)
