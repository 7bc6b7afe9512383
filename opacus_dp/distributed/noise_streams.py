"""A noise stream per rank, for reducers whose ranks each noise their own shard (FSDP2).

Under DDP one rank adds all the noise. Under FSDP2 every rank noises its own rows, so the
ranks' generators must be independent: training scripts seed every rank alike
(``torch.manual_seed(0)`` everywhere, or the same ``noise_generator``), and identical streams
would add the *same* draws to different coordinates — noise whose differences cancel, a
mechanism the accountant does not describe. Each rank's generator is therefore reseeded with

    seed_r = SHA-256("opacus_dp noise stream" ‖ base ‖ r)  (first 62 bits),

``base`` being the state of the generator the user gave (or the seed the optimizer drew from the
global RNG): a seeded run stays reproducible, ranks never share a stream, and a rank's stream
depends on nothing the other ranks draw. In secure mode every step is seeded from the OS on
every rank, independent already. The streams' states are checkpointed per rank.
"""

import hashlib

_DOMAIN = b"opacus_dp noise stream"


def rank_seed(base: bytes, rank: int) -> int:
    """The 62-bit seed of ``rank``'s stream derived from ``base`` (module doc)."""
    digest = hashlib.sha256(_DOMAIN + base + int(rank).to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def own_stream_per_rank(dp_optimizer) -> None:
    """Under a reducer whose ranks each noise their own shard (FSDP2), reseed this rank's noise
    with its own stream derived from the stream just loaded or seeded (every rank may have loaded
    rank 0's): deterministic and independent across ranks. Nothing under other reducers (one
    stream, rank 0's) or in secure mode."""
    reducer = dp_optimizer.reducer
    if reducer.shards:
        give_rank_its_stream(dp_optimizer.noise, reducer.rank)


def give_rank_its_stream(noise, rank: int) -> None:
    """Reseed ``noise`` (a :class:`~opacus_dp.optim.noise.GaussianNoise`) with ``rank``'s stream;
    nothing in secure mode. The user's generator object is not changed (a new one replaces it)."""
    if not noise.secure_mode:
        noise.reseed(rank_seed(noise.stream_base(), rank))
