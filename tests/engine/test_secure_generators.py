"""Secure mode's generators take their whole state from the OS: torch's CPU ``manual_seed`` keeps
only 32 bits of a seed (2³² candidates: few enough to search for the noise of a released step),
so a secure CPU generator is never made with ``manual_seed``."""

import numpy as np
import torch

from opacus_dp.engine.optimizer import secure_generator
from opacus_dp.optim.keyed_generators import MT_WORDS, os_seeded_generator, state_template
from opacus_dp.optim.noise import GaussianNoise

_WORDS = slice(24, 24 + 8 * MT_WORDS)


def _words(generator: torch.Generator) -> np.ndarray:
    return generator.get_state().numpy()[_WORDS].view("<u8")


def test_manual_seed_keeps_only_32_bits_so_it_is_not_used():
    seed = 12345
    a = torch.Generator().manual_seed(seed)
    b = torch.Generator().manual_seed(seed + 2**40)
    assert torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))  # why the words are drawn


def test_an_os_seeded_generator_is_no_generator_manual_seed_makes():
    for make in (os_seeded_generator, secure_generator):
        generator = make()
        words = _words(generator)
        assert words.max() < 2**32 and len(np.unique(words)) > MT_WORDS - 5  # 624 fresh 32-bit words
        seeded = torch.Generator().manual_seed(int(words[0]))  # the 32-bit seed that would give word 0
        assert not np.array_equal(_words(seeded), words)
        assert generator.initial_seed() != state_template().numpy()[:8].view("<u8")[0]


def test_two_secure_generators_and_two_secure_steps_draw_differently_whatever_the_global_seed():
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        noise = GaussianNoise(secure_mode=True)
        for _ in range(2):
            noise.begin_step(torch.device("cpu"))
            draws.append(noise.sample(torch.zeros(64), 1.0))
    for i in range(len(draws)):
        for j in range(i):
            assert not torch.equal(draws[i], draws[j])
    assert 0.7 < torch.cat(draws).std().item() < 1.3  # still N(0, 1) (four draws summed, ÷ 2)
