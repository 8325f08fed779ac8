"""An independent float64 Llama forward for the model tests.

Written apart from shadowprefill/model on purpose: it reads the Hugging Face-named tensors (separate
q/k/v and gate/up), rotates with complex numbers, loops over heads, and builds the causal / sliding-window
mask by hand. It shares nothing with the model but the config.
"""
import math

import torch


def inv_freq(config):
    """RoPE frequencies, float64, with the Llama-3.1 / linear rules written out per frequency."""
    d = config.head_dim
    out = []
    for j in range(d // 2):
        f = config.rope_theta ** (-2.0 * j / d)
        rs = config.rope_scaling
        if rs is not None and rs.kind == "linear":
            f = f / rs.factor
        elif rs is not None and rs.kind == "llama3":
            wavelen = 2 * math.pi / f
            if wavelen < rs.original_max_position / rs.high_freq_factor:
                pass
            elif wavelen > rs.original_max_position / rs.low_freq_factor:
                f = f / rs.factor
            else:
                smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
                    rs.high_freq_factor - rs.low_freq_factor)
                f = (1 - smooth) * f / rs.factor + smooth * f
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


def rotate(x, positions, freqs):
    """x [L, D]: pair (x[j], x[j + D/2]) as a complex number times exp(i * position * f_j)."""
    half = x.shape[1] // 2
    z = torch.complex(x[:, :half], x[:, half:])
    z = z * torch.polar(torch.ones(len(positions), half, dtype=torch.float64),
                        positions[:, None].double() * freqs[None, :])
    return torch.cat([z.real, z.imag], dim=1)


def dense_logits(hf_tensors, config, tokens):
    """float64 logits [len(tokens), vocab] of a Llama-family model given its Hugging Face tensors."""
    w = {name: t.detach().double().cpu() for name, t in hf_tensors.items()}
    eps, d = config.rms_norm_eps, config.head_dim
    group = config.num_heads // config.num_kv_heads

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(dim=1, keepdim=True) + eps) * weight

    def linear(x, prefix):
        y = x @ w[prefix + ".weight"].T
        return y + w[prefix + ".bias"] if prefix + ".bias" in w else y

    n = len(tokens)
    positions = torch.arange(n)
    freqs = inv_freq(config)
    mask = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            hidden = j > i or (config.sliding_window is not None and j <= i - config.sliding_window)
            mask[i, j] = float("-inf") if hidden else 0.0
    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        h = rms(x, w[p + ".input_layernorm.weight"])
        q, k, v = (linear(h, f"{p}.self_attn.{name}") for name in ("q_proj", "k_proj", "v_proj"))
        heads = []
        for head in range(config.num_heads):
            kv_head = head // group
            qh = rotate(q[:, head * d:(head + 1) * d], positions, freqs)
            kh = rotate(k[:, kv_head * d:(kv_head + 1) * d], positions, freqs)
            vh = v[:, kv_head * d:(kv_head + 1) * d]
            probs = torch.softmax(qh @ kh.T / math.sqrt(d) + mask, dim=1)
            heads.append(probs @ vh)
        x = x + linear(torch.cat(heads, dim=1), f"{p}.self_attn.o_proj")
        h = rms(x, w[p + ".post_attention_layernorm.weight"])
        gate, up = linear(h, f"{p}.mlp.gate_proj"), linear(h, f"{p}.mlp.up_proj")
        x = x + linear(gate * torch.sigmoid(gate) * up, f"{p}.mlp.down_proj")
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def hf_tensors_of(model):
    """The model's weights under Hugging Face names, split by hand from the fused parameters."""
    c = model.config
    out = {}
    for name, param in model.named_parameters():
        t = param.detach()
        if ".qkv_proj." in name:
            prefix, suffix = name.split(".qkv_proj.")
            out[f"{prefix}.q_proj.{suffix}"] = t[:c.num_heads * c.head_dim]
            out[f"{prefix}.k_proj.{suffix}"] = t[c.num_heads * c.head_dim:(c.num_heads + c.num_kv_heads) * c.head_dim]
            out[f"{prefix}.v_proj.{suffix}"] = t[(c.num_heads + c.num_kv_heads) * c.head_dim:]
        elif ".gate_up_proj." in name:
            prefix, suffix = name.split(".gate_up_proj.")
            out[f"{prefix}.gate_proj.{suffix}"] = t[:c.intermediate_size]
            out[f"{prefix}.up_proj.{suffix}"] = t[c.intermediate_size:]
        else:
            out[name] = t
    return out
