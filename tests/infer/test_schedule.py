"""The engine's records (:mod:`neuron_tp.infer.schedule`): a lease (prefix-cache plans too) and
the shutdown message come back from their ``host_broadcast`` bytes unchanged; an unseeded
sampled request is admitted with a seed of its own, a seeded or greedy one keeps its sampling."""

from __future__ import annotations

from neuron_tp.infer.prefix_cache import PrefixPlan
from neuron_tp.infer.sampling import MAX_SEED, Sampling
from neuron_tp.infer.schedule import Admission, Lease, Output, Request, Shutdown, decode, encode


def _request(sampling: Sampling, seeded: bool) -> Request:
    return Request([1, 2, 3], 5, sampling, ["\n"], seeded, sink=lambda ev: None)


def test_messages_round_trip():
    lease = Lease(
        cancel=(2, 0),
        admit=(
            Admission((5, 6), 4, Sampling(), ()),
            Admission((7,), 1, Sampling(True, 0.7, 20, MAX_SEED), ("a", "bc")),
            Admission((1, 2, 3), 2, Sampling(), (), PrefixPlan((4, 0), (7,))),
            Admission(
                (9, 8),
                0,
                Sampling(True, 1.1, 0, 3, 0.9, 0.05, 0.5, -0.5, 1.2, ((7, -2.5), (3, 1.0))),
                (),
                None,
                Output(logprobs=True, prompt_logprobs=True, stop_ids=(4, 5)),
            ),
        ),
        steps=3,
    )
    assert decode(encode(lease)) == lease
    assert decode(encode(Shutdown())) == Shutdown()


def test_admission_seeds_an_unseeded_sampled_request():
    sampled = Sampling(True, 0.9, 5, 0, top_p=0.8, presence_penalty=0.3)
    admitted = Admission.of(_request(sampled, seeded=False))
    assert admitted.sampling.temperature == 0.9 and admitted.sampling.top_k == 5
    assert admitted.sampling.top_p == 0.8 and admitted.sampling.presence_penalty == 0.3
    assert 0 <= admitted.sampling.seed <= MAX_SEED
    assert Admission.of(_request(Sampling(True, 0.9, 5, 7), seeded=True)).sampling.seed == 7
    greedy = Admission.of(_request(Sampling(), seeded=False))
    assert greedy == Admission((1, 2, 3), 5, Sampling(), ("\n",))
