"""A small random Llama checkpoint, made on the spot, for running a real engine without a download.

The weights are drawn from N(0, std) with a seeded generator, so every parameter differs from
every other and the TP shards of one layer hold different KV heads: a connector that mixes up
ranks, pages or layers changes the tokens. A large std (0.5) makes attention sharp, so the KV of
every earlier position matters to the next token. No tokenizer: prompts are token ids.
"""

from __future__ import annotations

import json
from pathlib import Path


def make_tiny_llama(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 512,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    std: float = 0.5,
    seed: int = 0,
    sliding_window: int = 0,
) -> Path:
    """Write a random Llama (config.json + model.safetensors) into ``path``; returns the path.
    ``sliding_window`` > 0: a Mistral instead (the same weights; every layer attends to the last
    ``sliding_window`` tokens only)."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if sliding_window:
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=sliding_window)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    tensors = {
        "model.embed_tokens.weight": rand(vocab_size, hidden_size),
        "model.norm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
        "lm_head.weight": rand(vocab_size, hidden_size),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": rand(q, hidden_size),
                p + "self_attn.k_proj.weight": rand(kv, hidden_size),
                p + "self_attn.v_proj.weight": rand(kv, hidden_size),
                p + "self_attn.o_proj.weight": rand(hidden_size, q),
                p + "mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
                p + "mlp.up_proj.weight": rand(intermediate_size, hidden_size),
                p + "mlp.down_proj.weight": rand(hidden_size, intermediate_size),
            }
        )
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def make_tiny_gemma2(
    path: str | Path,
    *,
    num_layers: int = 4,
    sliding_window: int = 64,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 512,
    std: float = 0.5,
    embed_std: float = 0.05,
    seed: int = 0,
) -> Path:
    """Write a random Gemma 2 (sliding-window and full-attention layers interleaved) into ``path``
    with transformers' own class; weights from N(0, std) as above, norms at their identity. Gemma
    scales embeddings by sqrt(hidden_size), so they are drawn from N(0, embed_std): with them as
    large as the rest, a token's own embedding decides the next token and the KV hardly matters."""
    import torch
    import transformers

    config = transformers.Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    gen = torch.Generator().manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.zero_()  # Gemma's RMSNorm scales by (1 + weight)
            else:
                scale = embed_std if "embed" in name else std
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    path = Path(path)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def make_tiny_granite_mamba2(path: str | Path, *, seed: int = 0, std: float = 0.5, embed_std: float = 0.05) -> Path:
    """Write a random Granite-style Mamba2 hybrid (Mamba2 layers interleaved with attention, no
    experts) into ``path`` with transformers' own class and its own initialisation."""
    import torch
    import transformers

    config = transformers.GraniteMoeHybridConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        num_local_experts=0,
        shared_intermediate_size=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.GraniteMoeHybridForCausalLM(config)
    # As in make_tiny_gemma2: the layers' weights from N(0, std) and small embeddings, so that what a
    # layer carries from earlier tokens (the attention KV, the Mamba state) decides the next token
    # rather than the token's own embedding. The Mamba layers' decay, skip and step parameters keep
    # their initialisation.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.rsplit(".", 1)[-1] in ("A_log", "D", "dt_bias"):
                continue
            scale = embed_std if "embed" in name else std
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    path = Path(path)
    model.to(torch.bfloat16).save_pretrained(path)
    return path
