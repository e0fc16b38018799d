"""Golden numbers for kernels/tests/ops_rope.rs from Hugging Face transformers.

Writes rope_golden.rs (next to this script): the inverse frequencies and attention scaling of
transformers' RoPE initializers (default, linear, llama3, yarn) for a few configs, and the
rotated q of transformers' own apply functions (Llama/Phi-3 half-split, GPT-J interleaved)
on a small float64 input. The tests read only the generated file; this script documents
where the numbers come from and regenerates them:

    pip install torch transformers
    python kernels/tests/data/rope_golden.py

transformers computes the frequencies and the cos/sin tables in float32 (even for a float64
model), so these agree with an exact float64 computation to about 1e-6, not to the last bit.
"""

import math
import os

import torch
import transformers
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply


def lit(v):
    v = float(v)
    assert math.isfinite(v)
    s = repr(v)
    return s if ("." in s or "e" in s) else s + ".0"


def opt(v):
    return "None" if v is None else f"Some({lit(v)})"


def scaling_rs(p):
    t = p["rope_type"]
    if t == "default":
        return "RopeScaling::None"
    if t == "linear":
        return f"RopeScaling::Linear {{ factor: {lit(p['factor'])} }}"
    if t == "llama3":
        return (
            f"RopeScaling::Llama3 {{ factor: {lit(p['factor'])}, low_freq_factor: {lit(p['low_freq_factor'])}, "
            f"high_freq_factor: {lit(p['high_freq_factor'])}, "
            f"original_max_position_embeddings: {p['original_max_position_embeddings']} }}"
        )
    if t == "yarn":
        return (
            f"RopeScaling::Yarn {{ factor: {lit(p['factor'])}, "
            f"original_max_position_embeddings: {p['original_max_position_embeddings']}, "
            f"beta_fast: {lit(p.get('beta_fast') or 32)}, beta_slow: {lit(p.get('beta_slow') or 1)}, "
            f"attention_factor: {opt(p.get('attention_factor'))}, mscale: {opt(p.get('mscale'))}, "
            f"mscale_all_dim: {opt(p.get('mscale_all_dim'))}, truncate: {str(p.get('truncate', True)).lower()} }}"
        )
    raise ValueError(t)


def rope_rs(head_dim, rotary_dim, p, style):
    return (
        f"Rope {{ head_dim: {head_dim}, rotary_dim: {rotary_dim}, theta: {lit(p['rope_theta'])}, "
        f"style: RopeStyle::{style}, scaling: {scaling_rs(p)}, heads: RotatedHeads::ALL }}"
    )


def init(head_dim, p, max_pos=8192):
    """transformers' inverse frequencies and attention scaling for one config."""
    partial = p.get("partial_rotary_factor", 1.0)
    if "original_max_position_embeddings" in p:
        # The extended context, as a scaled checkpoint's config states it.
        max_pos = int(p["original_max_position_embeddings"] * p["factor"])
    if p["rope_type"] == "default":
        cfg = Phi3Config(hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=max_pos, rope_parameters=dict(p))
        inv, a = Phi3RotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        cfg = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=dict(p))
        inv, a = ROPE_INIT_FUNCTIONS[p["rope_type"]](cfg)
    return cfg, inv, float(a), int(head_dim * partial)


FREQS = [
    ("default", 64, {"rope_type": "default", "rope_theta": 10000.0}),
    ("default_partial", 64, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ("default_qwen2", 128, {"rope_type": "default", "rope_theta": 1000000.0}),
    ("linear", 32, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ("llama3_1", 128, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ("llama3_short", 32, {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    ("yarn", 64, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048}),
    ("yarn_qwen", 128, {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("yarn_betas_mscale", 64, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 1024, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),
    ("yarn_attention_factor", 32, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 1.5, "partial_rotary_factor": 0.5}),
]

POSITIONS = [3, 0, 1, 2, 17, 31]


def x_values(tokens, width):
    return torch.tensor([[math.sin(0.37 * (t * width + j) + 0.1) for j in range(width)] for t in range(tokens)], dtype=torch.float64)


def apply_half_split(head_dim, heads, p):
    """Llama's rotary embedding (any rope_type) with Phi-3's apply (a partial rotary dim)."""
    cfg, _, _, rot = init(head_dim, p, max_pos=64)
    emb = (Phi3RotaryEmbedding if p["rope_type"] == "default" else LlamaRotaryEmbedding)(cfg)
    x = x_values(len(POSITIONS), heads * head_dim)
    q = x.view(1, len(POSITIONS), heads, head_dim).transpose(1, 2)  # [1, heads, tokens, d]
    pos = torch.tensor([POSITIONS])
    cos, sin = emb(q, pos)
    y, _ = phi3_apply(q, q, cos, sin)
    return x, y.transpose(1, 2).reshape(len(POSITIONS), heads * head_dim), rot


def apply_interleaved(head_dim, rotary_dim, heads):
    """GPT-J: its sinusoid table (base 10000) and apply on the first rotary_dim columns."""
    x = x_values(len(POSITIONS), heads * head_dim)
    q = x.view(1, len(POSITIONS), heads, head_dim)  # GPT-J's [batch, tokens, heads, d]
    table = create_sinusoidal_positions(64, rotary_dim)[torch.tensor([POSITIONS])].to(torch.float64)
    sin, cos = torch.split(table, table.shape[-1] // 2, dim=-1)
    rot = gptj_apply(q[..., :rotary_dim], sin, cos)
    y = torch.cat([rot, q[..., rotary_dim:]], dim=-1)
    return x, y.reshape(len(POSITIONS), heads * head_dim)


APPLY = [
    ("half_split_default", 8, 2, {"rope_type": "default", "rope_theta": 10000.0}),
    ("half_split_partial", 8, 2, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ("half_split_linear", 8, 2, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("half_split_llama3", 16, 1, {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ("half_split_yarn", 8, 2, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
]


def vec(t):
    return "&[" + ", ".join(lit(v) for v in t.flatten().tolist()) + "]"


def main():
    out = [
        f"// Generated by rope_golden.py from transformers {transformers.__version__} (torch {torch.__version__}).",
        "// Do not edit: rerun the script.",
        "",
        "const FREQ_CASES: &[FreqCase] = &[",
    ]
    for name, d, p in FREQS:
        _, inv, a, rot = init(d, p)
        out.append(
            f"    FreqCase {{ name: {name!r}, rope: {rope_rs(d, rot, p, 'HalfSplit')}, inv_freq: {vec(inv.double())}, attention_scaling: {lit(a)} }},".replace("'", '"')
        )
    out += ["];", "", f"const APPLY_POSITIONS: &[usize] = &{POSITIONS};", "", "const APPLY_CASES: &[ApplyCase] = &["]
    for name, d, heads, p in APPLY:
        x, y, rot = apply_half_split(d, heads, p)
        out.append(f"    ApplyCase {{ name: \"{name}\", rope: {rope_rs(d, rot, p, 'HalfSplit')}, x: {vec(x)}, y: {vec(y)} }},")
    for name, d, rot, heads in [("interleaved_gptj", 8, 8, 2), ("interleaved_gptj_partial", 8, 4, 2)]:
        x, y = apply_interleaved(d, rot, heads)
        p = {"rope_type": "default", "rope_theta": 10000.0}
        out.append(f"    ApplyCase {{ name: \"{name}\", rope: {rope_rs(d, rot, p, 'Interleaved')}, x: {vec(x)}, y: {vec(y)} }},")
    out += ["];", ""]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rope_golden.rs")
    with open(path, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
