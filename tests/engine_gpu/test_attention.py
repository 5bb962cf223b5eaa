"""The paged path (block tables, chunked prefill, mixed batches) against the contiguous forward."""

from __future__ import annotations

import sys

import pytest
import torch
from runner_batches import scheduled
from tiny_checkpoint import random_weights, tiny_config, write_hf_checkpoint

from engine_gpu.attention import base, get_attention_backend
from engine_gpu.attention.base import SMALL_QUERY, PagedLayout, query_group
from engine_gpu.attention.torch_backend import TorchAttentionBackend
from engine_gpu.kv_cache import PagedKVCache, blocks_for_budget, bytes_per_block
from engine_gpu.runner import ModelRunner
from engine_gpu.sched_output import ScheduledSeq
from llm_shared.errors import ConfigError
from llm_shared.llama.loader import load_safetensors, read_hf_args
from llm_shared.llama.model import LlamaModel

TOL = 1e-4
BLOCK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    config = tiny_config()
    directory = write_hf_checkpoint(tmp_path_factory.mktemp("hf"), config, random_weights(config, seed=3))
    return load_safetensors(directory, dtype=torch.float32)


def make_runner(model: LlamaModel, num_blocks: int = 64) -> ModelRunner:
    cache = PagedKVCache.for_model(model.args, block_size=BLOCK, dtype=torch.float32, device="cpu",
                                   num_blocks=num_blocks)
    return ModelRunner(model, cache, device="cpu", dtype=torch.float32, attention_backend="torch")


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward_contiguous(torch.tensor([ids]))[0][0]  # [T, vocab]


def item(rid: str, ids: list[int], start: int, table: list[int]) -> ScheduledSeq:
    return scheduled(rid, ids, start, table)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() < TOL


@pytest.mark.parametrize("chunks", [[40], [5, 17, 3, 1, 14], [8, 8, 8, 8, 8], [1] * 12 + [28]])
def test_chunked_prefill_matches_contiguous(model: LlamaModel, chunks: list[int]) -> None:
    runner = make_runner(model)
    ids = tokens(sum(chunks), seed=1)
    table = [17, 3, 40, 9, 22]  # scattered physical blocks
    got, pos = [], 0
    for n in chunks:
        got.append(runner.execute_logits([item("a", ids[pos:pos + n], pos, table)])[0])
        pos += n
    assert close(torch.cat(got), reference(model, ids))


def test_mixed_batch_at_different_positions(model: LlamaModel) -> None:
    """One step holding a prompt chunk, a first chunk, decodes and a multi-token (draft-like) item."""
    runner = make_runner(model)
    seqs = {name: tokens(n, seed=i) for i, (name, n) in enumerate([("a", 50), ("b", 30), ("c", 21), ("d", 9)])}
    tables = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [10, 11, 12, 13], "c": [20, 21, 22], "d": [30, 31]}
    # warm-up steps put different amounts of each sequence in the cache
    cached = {"a": 20, "b": 29, "c": 12, "d": 0}
    runner.execute_logits([item(n, seqs[n][:k], 0, tables[n]) for n, k in cached.items() if k])
    step = [
        item("a", seqs["a"][20:50], 20, tables["a"]),  # long chunk (own SDPA group)
        item("b", seqs["b"][29:30], 29, tables["b"]),  # decode
        item("d", seqs["d"][0:9], 0, tables["d"]),  # a whole short prompt
        item("c", seqs["c"][12:16], 12, tables["c"]),  # 4 tokens, like 1 + 3 drafts
    ]
    assert len(step[0].token_ids) > SMALL_QUERY
    got = runner.execute_logits(step)
    for it, logits in zip(step, got, strict=True):
        full = reference(model, seqs[it.request_id][: it.start_pos + len(it.token_ids)])
        assert close(logits, full[it.start_pos:]), it.request_id


def test_shared_prefix_blocks(model: LlamaModel) -> None:
    """Two sequences read the same physical prefix blocks, written once by the first."""
    runner = make_runner(model)
    prefix = tokens(16, seed=5)  # exactly two blocks
    a = prefix + tokens(7, seed=6)
    b = prefix + tokens(12, seed=7)
    runner.execute_logits([item("a", a, 0, [4, 9, 2])])
    # b reuses blocks 4 and 9 and computes only its own suffix, batched with a's decode
    got_b, got_a = runner.execute_logits([item("b", b[16:], 16, [4, 9, 11, 12]), item("a", [33], 23, [4, 9, 2])])
    assert close(got_b, reference(model, b)[16:])
    assert close(got_a, reference(model, [*a, 33])[23:])


def test_kv_lands_in_the_slot_the_block_table_names(model: LlamaModel) -> None:
    runner = make_runner(model)
    ids = tokens(13, seed=8)
    table = [6, 2]
    runner.execute_logits([item("a", ids, 0, table)])
    with torch.inference_mode():
        _, past = model.forward_contiguous(torch.tensor([ids]))
    k_ref, v_ref = (t[0].transpose(0, 1) for t in past[1])  # layer 1: [T, KVH, D]
    slots = torch.tensor([table[pos // BLOCK] * BLOCK + pos % BLOCK for pos in range(13)])
    k_got, v_got = runner.kv_cache.read(1, slots)
    assert (k_got - k_ref).abs().max().item() < TOL
    assert (v_got - v_ref).abs().max().item() < TOL
    k_cache, _ = runner.kv_cache.layer(1)  # heads first: [KVH, num_blocks, block_size, D]
    assert k_cache[:, 6].abs().sum().item() > 0
    assert k_cache[:, 0].abs().sum().item() == 0  # untouched blocks stay untouched


@pytest.mark.parametrize("layout", ["blocks_first", "heads_first"])
def test_pool_layouts_write_and_read_the_same_slots(layout: str) -> None:
    cache = PagedKVCache(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=3, head_dim=2,
                         dtype=torch.float32, device="cpu", layout=layout)  # type: ignore[arg-type]
    slots = torch.tensor([17, 0, 6])
    k, v = torch.randn(3, 3, 2), torch.randn(3, 3, 2)
    cache.write(1, slots, k, v)
    assert all(torch.equal(a, b) for a, b in zip(cache.read(1, slots), (k, v), strict=True))
    assert cache.k[0].abs().sum() == 0
    k_layer, _ = cache.layer(1)
    block_17 = k_layer[4, 1] if layout == "blocks_first" else k_layer[:, 4, 1]  # slot 17 = block 4, offset 1
    assert torch.equal(block_17, k[0])


@pytest.fixture(params=["folded_sdpa", "matmul"])
def small_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Short queries through one kernel or the other, whatever the group's size."""
    monkeypatch.setattr(base, "FOLDED_SDPA_ROWS", {torch.float32: 99 if request.param == "folded_sdpa" else 0})
    return request.param


def test_padded_decode_group_with_unequal_lengths(model: LlamaModel, small_kernel: str) -> None:
    runner = make_runner(model)
    seqs = [tokens(n, seed=10 + n) for n in (3, 17, 33)]
    tables = [[0], [5, 6, 7], [8, 9, 10, 11, 12]]
    runner.execute_logits([item(str(i), s[:-2], 0, t) for i, (s, t) in enumerate(zip(seqs, tables, strict=True))])
    # 2, 1 and 2 new tokens: one padded SDPA group
    step = [item("0", seqs[0][-2:], 1, tables[0]), item("1", seqs[1][-2:-1], 15, tables[1]),
            item("2", seqs[2][-2:], 31, tables[2])]
    got = runner.execute_logits(step)
    assert close(got[0], reference(model, seqs[0])[1:])
    assert close(got[1], reference(model, seqs[1][:-1])[15:])
    assert close(got[2], reference(model, seqs[2])[31:])


def test_pool_sizing() -> None:
    config = tiny_config()
    args = read_hf_args(config, "tiny")
    per_block = bytes_per_block(args, 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 2  # K+V, layers, tokens, KV heads, head dim, bytes
    assert blocks_for_budget(args, block_size=16, dtype=torch.bfloat16, kv_cache_mib=1) == 2**20 // per_block
    cache = PagedKVCache.for_model(args, block_size=16, dtype=torch.bfloat16, device="cpu", kv_cache_mib=1)
    assert cache.num_blocks == 2**20 // per_block
    assert cache.num_bytes <= 2**20
    assert PagedKVCache.for_model(args, block_size=16, dtype=torch.bfloat16, device="cpu", num_blocks=5).num_blocks == 5


def test_backend_choice_on_cpu_never_imports_flash_attn() -> None:
    kwargs = {"device": "cpu", "block_size": 16, "num_heads": 4, "num_kv_heads": 2}
    assert isinstance(get_attention_backend("auto", **kwargs), TorchAttentionBackend)
    assert isinstance(get_attention_backend("torch", **kwargs), TorchAttentionBackend)
    with pytest.raises(ConfigError, match="cuda"):
        get_attention_backend("flash_attn", **kwargs)
    with pytest.raises(ConfigError, match=r"engine\.attention"):
        get_attention_backend("xformers", **kwargs)
    assert "flash_attn" not in sys.modules


def test_flash_backend_rejects_small_pages_fp32_and_the_wrong_pool(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    from engine_gpu.attention.flash_backend import FlashAttentionBackend

    with pytest.raises(ConfigError, match="multiple of 256"):
        FlashAttentionBackend(16)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_flash_varlen))
    cache = PagedKVCache.for_model(model.args, block_size=256, dtype=torch.float32, device="cpu", num_blocks=2)
    with pytest.raises(ValueError, match="blocks_first"):
        ModelRunner(model, cache, device="cpu", dtype=torch.float32, attention_backend=FlashAttentionBackend(256))
    with pytest.raises(ConfigError, match="bfloat16"):
        get_attention_backend("flash_attn", device="cuda", block_size=256, num_heads=4, num_kv_heads=2,
                              dtype=torch.float32)


def fake_flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                      block_table: torch.Tensor) -> torch.Tensor:
    """flash_attn_varlen_func's documented paged contract, in slow torch, for CPU tests."""
    assert causal and block_table.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
    assert k.shape[1] % 256 == 0
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        qb = q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]  # [Tq, H, D]
        lk = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert qb.shape[0] <= max_seqlen_q and lk <= max_seqlen_k
        blocks = block_table[b, : -(-lk // k.shape[1])].long()
        groups = q.shape[1] // k.shape[2]
        kb = k[blocks].flatten(0, 1)[:lk].repeat_interleave(groups, dim=1)  # [Lk, H, D]
        vb = v[blocks].flatten(0, 1)[:lk].repeat_interleave(groups, dim=1)
        scores = torch.einsum("thd,shd->hts", qb, kb) * q.shape[-1] ** -0.5
        tq = qb.shape[0]
        # bottom-right aligned causal mask, as flash-attn documents
        allowed = torch.arange(lk)[None, :] <= torch.arange(tq)[:, None] + (lk - tq)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", scores.softmax(-1), vb))
    return torch.cat(outs)


def test_flash_backend_call_convention(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packs the batch the way flash-attn's paged varlen kernel reads it (checked with a stand-in)."""
    import types

    from engine_gpu.attention.flash_backend import FlashAttentionBackend

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_flash_varlen))
    cache = PagedKVCache.for_model(model.args, block_size=256, dtype=torch.float32, device="cpu", num_blocks=6,
                                   layout="blocks_first")
    runner = ModelRunner(model, cache, device="cpu", dtype=torch.float32, attention_backend=FlashAttentionBackend(256))
    a, b = tokens(300, seed=21), tokens(40, seed=22)
    runner.execute_logits([item("a", a[:270], 0, [4, 1]), item("b", b[:39], 0, [2])])
    got_a, got_b = runner.execute_logits([item("a", a[270:], 270, [4, 1]), item("b", b[39:], 39, [2])])
    assert close(got_a, reference(model, a)[270:])
    assert close(got_b, reference(model, b)[39:])



def test_bfloat16_batch_of_equal_multi_token_items(tmp_path_factory: pytest.TempPathFactory) -> None:
    """bf16 kernels return other memory layouts than fp32 ones; the unpadded batched path must cope."""
    config = tiny_config()
    directory = write_hf_checkpoint(tmp_path_factory.mktemp("bf16"), config, random_weights(config, seed=3))
    model = load_safetensors(directory, dtype=torch.bfloat16)
    cache = PagedKVCache.for_model(model.args, block_size=BLOCK, dtype=torch.bfloat16, device="cpu", num_blocks=16)
    runner = ModelRunner(model, cache, device="cpu", dtype=torch.bfloat16, attention_backend="torch")
    seqs = [tokens(12, seed=30 + i) for i in range(3)]
    tables = [[3 * i, 3 * i + 1] for i in range(3)]
    runner.execute_logits([item(str(i), s[:8], 0, t) for i, (s, t) in enumerate(zip(seqs, tables, strict=True))])
    got = runner.execute_logits([item(str(i), s[8:], 8, t) for i, (s, t) in enumerate(zip(seqs, tables, strict=True))])
    for s, logits in zip(seqs, got, strict=True):
        expected = reference(model, s)[8:].float()
        assert (logits - expected).abs().max().item() < 0.25  # bf16 rounding, not a wrong attention
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_match_contiguous(model: LlamaModel, seed: int, small_kernel: str) -> None:
    """Random chunk sizes, random interleavings and scattered blocks: every step's logits are exact."""
    import random

    rng = random.Random(seed)
    runner = make_runner(model)
    blocks = list(range(64))
    rng.shuffle(blocks)
    seqs = [tokens(rng.randrange(5, 60), seed=100 * seed + i) for i in range(4)]
    tables = []
    for s in seqs:
        need = -(-len(s) // BLOCK)
        tables.append([blocks.pop() for _ in range(need)])
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        step = rng.sample(live, rng.randrange(1, len(live) + 1))
        batch = []
        for i in step:
            n = min(rng.choice([1, 1, 2, 4, 9, 20]), len(seqs[i]) - done[i])
            batch.append(item(str(i), seqs[i][done[i]:done[i] + n], done[i], tables[i]))
        for it, logits in zip(batch, runner.execute_logits(batch), strict=True):
            i = int(it.request_id)
            end = it.start_pos + len(it.token_ids)
            assert close(logits, reference(model, seqs[i][:end])[it.start_pos:]), (seed, it.request_id, it.start_pos)
            done[i] = end


@pytest.mark.parametrize(("dtype", "rows", "kernel"), [
    (torch.bfloat16, 1, "folded_sdpa"), (torch.bfloat16, 4, "folded_sdpa"), (torch.bfloat16, 8, "matmul"),
    (torch.float32, 2, "folded_sdpa"), (torch.float32, 4, "matmul"), (torch.float32, 1, "sdpa"),
])
def test_each_group_gets_the_kernel_measured_fastest_for_its_shape(dtype: torch.dtype, rows: int,
                                                                     kernel: str) -> None:
    """One SDPA call for a few short rows, matmuls for many, SDPA over the heads for a long chunk
    (the last case: 20 new tokens)."""
    cache = PagedKVCache(num_layers=1, num_blocks=16, block_size=BLOCK, num_kv_heads=1, head_dim=4, dtype=dtype,
                         device="cpu", layout="heads_first")
    n = 20 if kernel == "sdpa" else 1
    layout = PagedLayout(
        positions=torch.zeros(rows * n, dtype=torch.long), slot_mapping=torch.zeros(rows * n, dtype=torch.long),
        block_table=torch.arange(rows * 3).reshape(rows, 3), lengths=[n] * rows, starts=[4] * rows,
        num_blocks=[3] * rows)
    group = query_group(cache, layout, list(range(rows)), list(range(0, rows * n + 1, n)), dtype, True, 3)
    assert group.kernel == kernel
    assert group.mask.dtype == (torch.float32 if kernel == "matmul" else dtype)
