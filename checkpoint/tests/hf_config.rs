//! Hugging Face `config.json` files read into `HfConfig`: the transformers 5 spelling
//! (files written by transformers 5.25 for tiny models, `tests/data/hf_config/`, with the
//! script that made them) and the transformers 4.x spelling of published checkpoints; every
//! field that would change the model and is not implemented is refused by name.

use dtensor_checkpoint::hf::{Architecture, HfConfig};
use dtensor_checkpoint::Error;
use dtensor_kernels::ops::{RopeScaling, RopeStyle};
use std::path::{Path, PathBuf};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf_config")
        .join(name)
}

fn read(name: &str) -> HfConfig {
    let file = data(name);
    let text = std::fs::read_to_string(&file).unwrap();
    HfConfig::parse(&text, &file).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn parse(text: &str) -> Result<HfConfig, Error> {
    HfConfig::parse(text, Path::new("config.json"))
}

/// The error's field and message, or a panic naming what parsed.
fn refused(text: &str) -> (String, String) {
    match parse(text) {
        Err(e @ Error::Config { .. }) => {
            let Error::Config { ref field, .. } = e else {
                unreachable!()
            };
            (field.clone(), e.to_string())
        }
        Err(e) => panic!("not a config error: {e}"),
        Ok(c) => panic!("parsed: {c:?}"),
    }
}

#[test]
fn transformers_5_files_of_every_architecture() {
    let l = read("t5_llama.json");
    assert_eq!(l.architecture, Architecture::Llama);
    assert_eq!(
        (l.vocab_size, l.hidden_size, l.intermediate_size),
        (96, 32, 64)
    );
    assert_eq!(
        (l.layers, l.heads, l.kv_heads, l.head_dim, l.group()),
        (2, 4, 2, 8, 2)
    );
    assert_eq!(l.rope.style, RopeStyle::HalfSplit);
    assert_eq!(l.rope.theta, 500000.0);
    assert_eq!(
        l.rope.scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64
        }
    );
    assert!(l.tie_word_embeddings && !l.qkv_bias && !l.o_bias && !l.qk_norm);
    assert_eq!(
        (l.bos_token_id, l.eos_token_ids.clone()),
        (Some(1), vec![2])
    );

    let m = read("t5_mistral.json");
    assert_eq!(m.sliding_window, Some(16));
    assert_eq!(m.rope.scaling, RopeScaling::None);

    let q2 = read("t5_qwen2.json");
    assert!(
        q2.qkv_bias && !q2.o_bias,
        "Qwen2: QKV biases with no attention_bias key"
    );
    assert_eq!(
        q2.sliding_window, None,
        "Qwen2's window is off (use_sliding_window false)"
    );

    let q3 = read("t5_qwen3.json");
    assert!(q3.qk_norm && !q3.qkv_bias);
    assert_eq!(q3.head_dim, 16);

    let mx = read("t5_mixtral.json");
    let moe = mx.moe.as_ref().unwrap();
    assert_eq!(
        (moe.experts, moe.top_k, moe.expert_intermediate),
        (4, 2, 64)
    );
    assert!(
        moe.norm_topk_prob,
        "Mixtral always renormalises the top-k weights"
    );
    assert_eq!(mx.head_dim, 8, "Mixtral's null head_dim is hidden / heads");

    let qm = read("t5_qwen3_moe.json");
    let moe = qm.moe.as_ref().unwrap();
    assert_eq!(
        (moe.experts, moe.top_k, moe.expert_intermediate),
        (4, 2, 24)
    );
    assert!(moe.norm_topk_prob && qm.qk_norm);
    assert_eq!(qm.head_dim, 8, "Qwen3-MoE without head_dim: hidden / heads");
    assert_eq!(qm.bos_token_id, None);
}

/// Llama 3.1 8B's published config (transformers 4.43 spelling).
const LLAMA31: &str = r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
 "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
 "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
 "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
 "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
 "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
 "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
 "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
 "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
 "use_cache": true, "vocab_size": 128256}"#;

/// Qwen3 0.6B's published config (transformers 4.51 spelling).
const QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
 "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
 "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
 "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
 "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
 "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
 "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
 "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
 "vocab_size": 151936}"#;

/// Qwen3-30B-A3B's published config (transformers 4.51 spelling: `num_experts`).
const QWEN3_MOE: &str = r#"{"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
 "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
 "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
 "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
 "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
 "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32,
 "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
 "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
 "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
 "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
 "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
 "vocab_size": 151936}"#;

#[test]
fn transformers_4_spelling_of_published_configs() {
    let l = parse(LLAMA31).unwrap();
    assert_eq!((l.heads, l.kv_heads, l.head_dim), (32, 8, 128));
    assert_eq!(l.rope.theta, 500000.0);
    assert!(matches!(
        l.rope.scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            original_max_position_embeddings: 8192,
            ..
        }
    ));
    assert_eq!(l.eos_token_ids, vec![128001, 128008, 128009]);

    let q = parse(QWEN3).unwrap();
    assert_eq!(
        (q.head_dim, q.rope.theta, q.rope.scaling),
        (128, 1e6, RopeScaling::None)
    );
    assert!(q.tie_word_embeddings && q.qk_norm);

    let m = parse(QWEN3_MOE).unwrap();
    let moe = m.moe.unwrap();
    assert_eq!(
        (moe.experts, moe.top_k, moe.expert_intermediate),
        (128, 8, 768)
    );
    assert_eq!(m.intermediate_size, 6144);

    // `type` is the older name of `rope_type`; linear and YaRN read their settings.
    let linear = LLAMA31.replace(
        r#"{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
 "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
        r#"{"type": "linear", "factor": 2.0}"#,
    );
    assert_eq!(
        parse(&linear).unwrap().rope.scaling,
        RopeScaling::Linear { factor: 2.0 }
    );
    let yarn = QWEN3.replace(
        r#""rope_scaling": null"#,
        r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
    );
    assert_eq!(
        parse(&yarn).unwrap().rope.scaling,
        RopeScaling::yarn(4.0, 32768)
    );
}

#[test]
fn both_spellings_give_the_same_rope() {
    let five = LLAMA31.replace(r#""rope_theta": 500000.0,"#, "").replace(
        r#""rope_scaling": {"factor""#,
        r#""rope_parameters": {"rope_theta": 500000.0, "factor""#,
    );
    assert_eq!(parse(&five).unwrap().rope, parse(LLAMA31).unwrap().rope);
    // Both at once is ambiguous.
    let both = LLAMA31.replace(
        r#""rope_theta": 500000.0,"#,
        r#""rope_theta": 500000.0, "rope_parameters": {"rope_theta": 10000.0},"#,
    );
    assert_eq!(refused(&both).0, "rope_scaling");
}

#[test]
fn unimplemented_settings_are_refused_by_name() {
    let cases: &[(&str, &str, &str)] = &[
        (
            r#""hidden_act": "silu""#,
            r#""hidden_act": "gelu""#,
            "hidden_act",
        ),
        (
            r#""attention_dropout": 0.0"#,
            r#""attention_dropout": 0.1"#,
            "attention_dropout",
        ),
        (r#""mlp_bias": false"#, r#""mlp_bias": true"#, "mlp_bias"),
        (
            r#""pretraining_tp": 1"#,
            r#""pretraining_tp": 2"#,
            "pretraining_tp",
        ),
        (
            r#""use_cache": true"#,
            r#""use_cache": true, "quantization_config": {"bits": 4}"#,
            "quantization_config",
        ),
        (
            r#""use_cache": true"#,
            r#""use_cache": true, "some_new_switch": 1"#,
            "some_new_switch",
        ),
        (
            r#""rope_type": "llama3""#,
            r#""rope_type": "longrope""#,
            "rope_scaling.rope_type",
        ),
        (
            r#""low_freq_factor": 1.0,"#,
            r#""low_freq_factor": 1.0, "mscale": 2.0,"#,
            "rope_scaling.mscale",
        ),
        (
            r#""num_key_value_heads": 8"#,
            r#""num_key_value_heads": 5"#,
            "num_key_value_heads",
        ),
        (
            r#""hidden_size": 4096"#,
            r#""hidden_size": 0"#,
            "hidden_size",
        ),
        (
            r#""rms_norm_eps": 1e-05"#,
            r#""rms_norm_eps": "small""#,
            "rms_norm_eps",
        ),
        (
            r#""model_type": "llama""#,
            r#""model_type": "gpt2""#,
            "model_type",
        ),
        (r#""factor": 8.0"#, r#""factor": -8.0"#, "rope_scaling"),
    ];
    for (from, to, field) in cases {
        assert!(LLAMA31.contains(from), "{from}");
        let (got, msg) = refused(&LLAMA31.replace(from, to));
        assert_eq!(&got, field, "{to}: {msg}");
        assert!(msg.contains("config.json") && msg.contains(field), "{msg}");
    }
    // A switch another architecture reads is not silently accepted here: Mistral's window
    // on a Llama.
    let (f, _) = refused(&LLAMA31.replace(r#""mlp_bias": false"#, r#""sliding_window": 4096"#));
    assert_eq!(f, "sliding_window");
    // Qwen's sliding window (per layer) is not implemented.
    let (f, _) = refused(&QWEN3.replace(
        r#""use_sliding_window": false"#,
        r#""use_sliding_window": true"#,
    ));
    assert_eq!(f, "use_sliding_window");
    let (f, _) =
        refused(&QWEN3_MOE.replace(r#""mlp_only_layers": []"#, r#""mlp_only_layers": [0]"#));
    assert_eq!(f, "mlp_only_layers");
    let (f, _) = refused(&QWEN3_MOE.replace(
        r#""num_experts_per_tok": 8"#,
        r#""num_experts_per_tok": 200"#,
    ));
    assert_eq!(f, "num_experts_per_tok");
}

#[test]
fn a_missing_file_or_bad_json_names_the_file() {
    let dir = std::env::temp_dir().join("dtensor-hf-config-missing");
    let e = HfConfig::from_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
    let e = parse("{not json").unwrap_err().to_string();
    assert!(e.contains("config.json") && e.contains("not JSON"), "{e}");
}
