"""Writes the config.json that transformers 5 saves for a tiny model of each architecture
dtensor reads (its `rope_parameters` spelling), one file per architecture, for
checkpoint/tests/hf_config.rs. Run in a scratch virtual environment with transformers
installed (never a dependency of the project):

    python make_configs.py   # writes t5_<model_type>.json beside this script
"""
import json
import os

from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)

tiny = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
configs = {
    "llama": LlamaConfig(**tiny, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=True),
    "mistral": MistralConfig(**tiny, sliding_window=16),
    "qwen2": Qwen2Config(**tiny),
    "qwen3": Qwen3Config(**tiny, head_dim=16),
    "mixtral": MixtralConfig(**tiny, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": Qwen3MoeConfig(**tiny, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=24, norm_topk_prob=True),
}
here = os.path.dirname(os.path.abspath(__file__))
for name, cfg in configs.items():
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    with open(os.path.join(here, f"t5_{name}.json"), "w") as f:
        f.write(cfg.to_json_string(use_diff=True))
