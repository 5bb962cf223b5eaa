"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head), written once.

Layers never own a KV cache: each calls an attention object ``attention(layer, q, k, v)``.
The engine passes a paged attention step (engine_gpu.attention) over a flattened varlen batch
([1, N] tokens); ``forward_contiguous`` passes ``ContiguousAttention`` (past key/values as whole
tensors), plain tensor code that torch.onnx.export traces with dynamic batch and past length.
Q/K/V and gate/up are fused into one matmul each because per-op overhead dominates small-batch
decode on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llm_shared.errors import ModelFileError
from llm_shared.llama.matmul import Linear, linear
from llm_shared.llama.packed4 import Packed4
from llm_shared.llama.rope import RopeScaling, apply_rope, inv_frequencies, rope_cos_sin

PastKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [B, KVH, S, D]


@dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of a checkpoint, read from its metadata by llm_shared.llama.loader."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs (llama3 scaling, llama.cpp style)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelFileError(f"model metadata {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFileError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelFileError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ModelFileError("rms_norm_eps and rope_theta must be positive")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelFileError(
                f"rope_freqs has {len(self.rope_freq_factors)} factors, expected head_dim/2 = {self.head_dim // 2}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class Attention(Protocol):
    """What a layer calls: q [B, T, H, D], k/v [B, T, KVH, D] (RoPE applied) -> [B, T, H, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class ContiguousAttention:
    """Attention over ``past_kv`` plus the new tokens; collects the new past in ``present``."""

    def __init__(self, past_kv: PastKV | None, num_layers: int, key_mask: torch.Tensor | None = None) -> None:
        self.past = past_kv
        self.present: PastKV = []
        self.num_layers = num_layers
        # [B, S] (1 = real key, 0 = padding): lets sequences of different lengths share a batch
        # by left-padding their pasts (the ONNX edge backend's batched decode).
        self.key_mask = key_mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, T, H, D]; k, v: [B, T, KVH, D]
        k = k.transpose(1, 2)  # [B, KVH, T, D]
        v = v.transpose(1, 2)
        if self.past:
            past_k, past_v = self.past[layer]
            k = torch.cat((past_k, k), dim=2)  # [B, KVH, S, D]
            v = torch.cat((past_v, v), dim=2)
        self.present.append((k, v))
        groups = q.shape[2] // k.shape[1]
        # GQA by expand+flatten (no Python shape ints, so the trace stays dynamic).
        k_rep = k.unsqueeze(2).expand(-1, -1, groups, -1, -1).flatten(1, 2)  # [B, H, S, D]
        v_rep = v.unsqueeze(2).expand(-1, -1, groups, -1, -1).flatten(1, 2)
        t, s = q.shape[1], k.shape[2]
        rows = torch.arange(t, device=q.device).unsqueeze(1)
        cols = torch.arange(s, device=q.device).unsqueeze(0)
        mask = cols <= rows + (s - t)  # [T, S]: causal, offset by the cached prefix
        if self.key_mask is not None:
            mask = mask & self.key_mask.bool()[:, None, None, :]  # [B, 1, T, S]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_rep, v_rep, attn_mask=mask)
        return out.transpose(1, 2)  # [B, T, H, D]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale after casting back, exactly as HF does, so bf16 runs agree.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.wqkv = Linear(args.hidden_size, args.q_size + 2 * args.kv_size)
        self.wo = Linear(args.q_size, args.hidden_size)
        self.mlp_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.w_gate_up = Linear(args.hidden_size, 2 * args.intermediate_size)
        self.w_down = Linear(args.intermediate_size, args.hidden_size)
        self.split = (args.q_size, args.kv_size, args.kv_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        # x: [B, T, hidden]
        q, k, v = self.wqkv(self.attn_norm(x)).split(self.split, dim=-1)
        q = apply_rope(q.unflatten(-1, (self.num_heads, self.head_dim)), cos, sin)  # [B, T, H, D]
        k = apply_rope(k.unflatten(-1, (self.num_kv_heads, self.head_dim)), cos, sin)  # [B, T, KVH, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        o = attention(self.index, q, k, v)  # [B, T, H, D]
        x = x + self.wo(o.flatten(-2))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, *, init_weights: bool = True) -> None:
        super().__init__()
        self.args = args
        if init_weights:
            self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        else:  # an explicit weight skips the normal_ init, which on the meta device imports torch._dynamo too
            self.embed = nn.Embedding(args.vocab_size, args.hidden_size,
                                      _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    @classmethod
    def from_state_dict(cls, args: ModelArgs, state: dict[str, torch.Tensor], device: torch.device | str) -> LlamaModel:
        """A model holding exactly these tensors (adopted, not copied); RuntimeError if a name or
        shape is not what ``args`` needs."""
        with torch.device("meta"):  # no throwaway random init of the weights
            model = cls(args, init_weights=False)
        model.load_state_dict(state, strict=True, assign=True)
        model.reset_rope(device)
        return model.eval()

    def _inv_freq(self) -> torch.Tensor:
        a = self.args
        # On the CPU even while the model is built on the meta device: arithmetic on meta
        # tensors runs torch's Python reference kernels, whose first use imports torch._dynamo (~2 s).
        with torch.device("cpu"):
            return inv_frequencies(a.head_dim, a.rope_theta, a.rope_scaling, a.rope_freq_factors)

    def reset_rope(self, device: torch.device | str) -> None:
        """Recompute the RoPE buffer (after building on the meta device and assigning weights)."""
        self.inv_freq = self._inv_freq().to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """input_ids, positions [B, T] -> final-normed hidden states [B, T, hidden]."""
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., vocab] in the model dtype."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)

    def projection_weights(self) -> list[torch.Tensor]:
        """Every matrix a forward multiplies by (for ``matmul.tune``)."""
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return [head, *(m.weight for m in self.modules() if isinstance(m, Linear))]

    def packed_projections(self) -> list[tuple[torch.Tensor, Packed4]]:
        """The projections that kept their 4-bit blocks (``loader.attach_packed4``), with them."""
        return [(m.weight, m.packed) for m in self.modules() if isinstance(m, Linear) and m.packed is not None]

    def forward_contiguous(
        self,
        input_ids: torch.Tensor,
        past_kv: PastKV | None = None,
        position_offset: int | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PastKV]:
        """Reference/export path: input_ids [B, T] -> (logits [B, T, vocab], new past).

        ``position_offset`` defaults to the past length; all rows share it (no padding).
        """
        if position_offset is None:
            position_offset = past_kv[0][0].shape[2] if past_kv else 0
        steps = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = (steps + position_offset).unsqueeze(0).expand(input_ids.shape[0], -1)
        attention = ContiguousAttention(past_kv, self.args.num_layers)
        hidden = self.forward(input_ids, positions, attention)
        return self.compute_logits(hidden), attention.present
