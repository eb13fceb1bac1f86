"""The sampler against its definition."""

import torch

from slimlm.runtime.sampling import SamplingParams, filter_logits, sample


def test_sampling_draws_the_filtered_distribution():
    """The on-device exponential race draws each token with its top-k/top-p filtered probability."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -5.0]]).repeat(4000, 1)
    for params in (SamplingParams(temperature=0.7), SamplingParams(top_k=3), SamplingParams(top_p=0.8)):
        expected = filter_logits(logits[:1], [params]).softmax(-1)[0]
        gens = [torch.Generator().manual_seed(i) for i in range(len(logits))]
        counts = torch.bincount(torch.tensor(sample(logits, [params] * len(logits), gens).tokens), minlength=8)
        observed = counts / counts.sum()
        assert (observed[expected == 0] == 0).all()
        # 4000 draws: a binomial standard error of at most 0.008; allow 4 of them
        assert (observed - expected).abs().max() < 0.032, (observed, expected)
