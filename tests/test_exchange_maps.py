"""The receive-row maps of the expert-parallel exchanges (comm/exchange.py), against plain loops (CPU)."""

import pytest
import torch

pytest.importorskip("triton")

from megamoe import build_schedule  # noqa: E402
from megamoe.backends.triton.comm.exchange import _first_rows, receive_maps  # noqa: E402


def brute_first_rows(rank: list, token: list) -> list:
    return [r if rank[r] < 0 else min(q for q in range(len(rank)) if (rank[q], token[q]) == (rank[r], token[r]))
            for r in range(len(rank))]


@pytest.mark.parametrize("seed", range(20))
def test_first_rows_is_each_tokens_first_receive_row(seed):
    g = torch.Generator().manual_seed(seed)
    rows, tokens, world = int(torch.randint(1, 80, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)), 3
    rank = torch.randint(-1, world, (rows,), generator=g).int()
    token = torch.randint(0, tokens, (rows,), generator=g).int()
    got = _first_rows(rank, token, tokens, torch.arange(rows, dtype=torch.int32))
    assert got.tolist() == brute_first_rows(rank.tolist(), token.tolist())


@pytest.mark.parametrize("routing", ["distinct", "repeated"])
def test_receive_maps_of_a_schedule(routing):
    """Every field of receive_maps per receive row, from the schedule's row_src by plain loops; tokens on
    several experts (and, "repeated", twice on one expert) point at their first row."""
    T, E, k, block_m = 23, 6, 3, 8
    g = torch.Generator().manual_seed(1)
    if routing == "distinct":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    else:
        ids = torch.randint(0, E, (T, k), generator=g)
    s = build_schedule(ids, E, block_m=block_m)
    maps = receive_maps(s)
    used = int(s.expert_offsets[-1])
    src = s.row_src.tolist()
    rank = [src[r] // (T * k) if src[r] >= 0 else -1 for r in range(s.num_rows)]
    token = [(src[r] % (T * k)) // k if src[r] >= 0 else 0 for r in range(s.num_rows)]
    assert maps.src_rank.tolist() == rank
    assert maps.src_token.tolist() == token
    assert maps.in_use.tolist() == [0 if r < used else -1 for r in range(s.num_rows)]
    assert maps.first_row.tolist() == brute_first_rows(rank, token)
    assert (maps.first_row != maps.rows).sum() >= T, "most tokens have rows on several experts here"
