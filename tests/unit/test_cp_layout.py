"""cp_layout: the zigzag layouts are exact permutations, equal torch's context-parallel load balancers, and give
the positions, per-document positions and local cu_seqlens that the consumers (KDA's FLA path included) expect."""

import pytest
import torch

from torchtitan_glm.distributed import cp_layout
from torchtitan_glm.distributed.cp_layout import CPLayout, head_tail_indices, per_document_indices
from torchtitan_glm.models.glm5.seqinfo import doc_positions


def doc_ids_for(rows):
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


UNEVEN = [[13, 3, 30, 18], [64], [8, 24, 1, 31]]  # documents crossing chunk and rank boundaries
EVEN_PER_DOC = {2: [[8, 36, 20], [64], [4, 4, 56]], 4: [[16, 40, 8], [64], [8, 8, 48]]}  # multiples of 2*cp


def test_torch_balancers_present_on_this_torch():
    # the pinned torch (2.13 in CI) has both; on a torch without them the fallbacks below are used
    assert cp_layout._torch_balancers() is not None


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_head_tail_indices_equal_torch_and_fallback_and_definition(cp):
    t = 32
    got = head_tail_indices(t, cp)
    assert torch.equal(got, head_tail_indices(t, cp, use_torch=False))
    c = t // (2 * cp)
    for r in range(cp):  # rank r holds chunk r then chunk 2cp-1-r
        want = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert got[0, r * 2 * c:(r + 1) * 2 * c].tolist() == want


@pytest.mark.parametrize("cp", [2, 4])
def test_per_document_indices_equal_torch(cp):
    lengths = EVEN_PER_DOC[cp]
    got = per_document_indices(lengths, cp)
    assert got.shape == (3, 64)
    assert torch.equal(got, per_document_indices(lengths, cp, use_torch=False))
    theirs = cp_layout._torch_balancers()[1](lengths, cp, "cpu")._generate_indices().long()
    if cp_layout.torch_per_document_is_rank_major():
        assert torch.equal(got, theirs)
    else:  # torch <= 2.13: the same (document, rank) head+tail pairs, laid out document-major
        for b, row in enumerate(lengths):
            blocks, offset = [[] for _ in range(cp)], 0
            for n in row:
                for r in range(cp):
                    blocks[r] += theirs[b, offset + r * n // cp:offset + (r + 1) * n // cp].tolist()
                offset += n
            assert sum(blocks, []) == got[b].tolist()
    for b, row in enumerate(lengths):  # every document of the row is split head-tail on its own
        start = 0
        for n in row:
            c = n // (2 * cp)
            for r in range(cp):
                local = got[b, r * 64 // cp:(r + 1) * 64 // cp].tolist()
                assert set(range(start + r * c, start + (r + 1) * c)) <= set(local)
                assert set(range(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c)) <= set(local)
            start += n


def test_per_document_needs_divisible_lengths():
    with pytest.raises(ValueError, match="divisible by 2 x cp = 4.*row 0.*\\[13, 3, 30, 18\\]"):
        per_document_indices(UNEVEN[:1], 2)
    with pytest.raises(ValueError, match="not divisible by 2 x cp"):
        head_tail_indices(30, 4)


@pytest.mark.parametrize("per_document", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_round_trip_is_exact(cp, per_document):
    doc_ids = doc_ids_for(EVEN_PER_DOC[cp] if per_document else UNEVEN)
    x = torch.randn(3, 64, 5, 7)
    layout = CPLayout(cp, 0, per_document=per_document)
    zz = layout.to_zigzag(x, doc_ids=doc_ids)
    assert not torch.equal(zz, x)
    assert torch.equal(layout.from_zigzag(zz, doc_ids=doc_ids), x)
    parts = [CPLayout(cp, r, per_document=per_document).shard(x, doc_ids=doc_ids) for r in range(cp)]
    assert torch.equal(torch.cat(parts, 1), zz)  # shards are the rank-major slices of the zigzag tensor
    assert torch.equal(layout.from_zigzag(torch.cat(parts, 1), doc_ids=doc_ids), x)
    # another sequence dim: [B, H, T, D]
    y = torch.randn(3, 2, 64, 4)
    if not per_document:
        assert torch.equal(layout.from_zigzag(layout.to_zigzag(y, dim=2), dim=2), y)


@pytest.mark.parametrize("per_document", [False, True])
def test_positions_and_documents_follow_the_tokens(per_document):
    cp = 2
    doc_ids = doc_ids_for(EVEN_PER_DOC[cp] if per_document else UNEVEN)
    pos_in_doc = doc_positions(doc_ids, 3, 64, doc_ids.device)[0]
    tokens = torch.arange(64).expand(3, 64) * 10 + torch.arange(3).view(3, 1)
    for r in range(cp):
        layout = CPLayout(cp, r, per_document=per_document)
        positions = layout.local_positions(64, doc_ids=doc_ids).expand(3, -1)
        assert torch.equal(layout.shard(tokens, doc_ids=doc_ids), positions * 10 + torch.arange(3).view(3, 1))
        assert torch.equal(layout.local_pos_in_doc(doc_ids), pos_in_doc.gather(1, positions))
        assert torch.equal(layout.shard(doc_ids, doc_ids=doc_ids), doc_ids.gather(1, positions))


def _runs(x):
    cut = (torch.nonzero(x[1:] != x[:-1]).flatten() + 1).tolist()
    return [0, *cut, x.numel()]


def test_local_cu_seqlens_break_at_documents_joins_and_rows():
    cp = 2
    doc_ids = doc_ids_for(UNEVEN)
    layout = CPLayout(cp, 0)  # rank 0 holds global [0, 16) and [48, 64) of each row
    cu = layout.local_cu_seqlens(doc_ids).tolist()
    # row 0 docs [0,13) [13,16) [16,46) [46,64): local [0,13) [13,16) | join | [48,64) -> 3 segments
    # row 1 one doc: [0,16) | join | [48,64) -> 2; row 2 docs [0,8) [8,32) [32,33) [33,64): [0,8) [8,16) | [48,64)
    assert cu == [0, 13, 16, 32, 48, 64, 72, 80, 96]
    assert cu[-1] == 3 * 32
    seg = layout.local_segment_ids(doc_ids)
    assert [b for b in _runs(seg.flatten())] == cu


def test_local_cu_seqlens_equal_fla_context():
    """FLA's own rank-local cu_seqlens for its zigzag CP. Runs where FLA imports: tests/conftest.py hides FLA
    without CUDA, so on the GPU machine (it passed on CPU with triton installed before that hiding existed)."""
    get_cp_cu_seqlens = pytest.importorskip("fla.ops.cp.context").get_cp_cu_seqlens

    for cp in (2, 4):
        for row in UNEVEN:
            doc_ids = doc_ids_for([row])
            cu = torch.tensor([0, *torch.tensor(row).cumsum(0).tolist()])
            for r in range(cp):
                fla = get_cp_cu_seqlens(cu, world_size=cp, rank=r, layout="zigzag")
                assert CPLayout(cp, r).local_cu_seqlens(doc_ids).tolist() == fla.cu_seqlens_cpu.tolist()


def test_local_pieces():
    doc_ids = doc_ids_for(EVEN_PER_DOC[2])
    assert CPLayout(2, 1).local_pieces(64) == [[(16, 32), (32, 48)]]  # adjacent chunks stay two pieces
    pieces = CPLayout(2, 0, per_document=True).local_pieces(64, doc_ids=doc_ids)
    assert pieces[0] == [(0, 2), (6, 8), (8, 17), (35, 44), (44, 49), (59, 64)]
    seg = CPLayout(2, 1).local_segment_ids(doc_ids_for([[64]]))
    assert seg.tolist() == [[0] * 16 + [1] * 16]  # FLA restarts (and chains) at the chunk join


def test_rows_without_document_ids_keep_host_ids_under_cp():
    """A batch without document ids (data.document_masking = false) under context parallelism gets all-zero ids on
    the host as well as on the device, so the zigzag sharding and the KDA op never copy ids back from the device;
    each rank's shard is the one the explicit one-document ids give."""
    from torchtitan_glm.models.glm5.batch import train_batch

    tokens = torch.arange(32).view(2, 16)
    for rank in range(2):
        layout = CPLayout(size=2, rank=rank)
        got = train_batch(tokens, tokens, None, cp=(None, layout))
        want = train_batch(tokens, tokens, torch.zeros_like(tokens), cp=(None, layout))
        assert got.host_doc_ids is not None and got.host_doc_ids.ids.device.type == "cpu"
        assert not got.host_doc_ids.ids.any() and got.host_doc_ids.ids.shape == tokens.shape
        for a, b in zip(got[:4], want[:4]):
            assert torch.equal(a, b)
