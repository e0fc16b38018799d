"""Builds the tiny Hugging Face checkpoints under tests/fixtures/hf/ and their goldens.

Run in a scratch virtual environment that has torch and transformers (never a dependency
of the build); from the repository root:

    python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf/

For each architecture dtensor reads it writes one directory `tests/fixtures/hf/<name>/`:
what `save_pretrained` writes (config.json, generation_config.json, safetensors weights)
and `golden.json`, computed in float64 (`model.double()`) on the shared
`tests/fixtures/hf/ids.json`:

- `loss`: transformers' causal-LM loss (labels = the ids, shifted by one, mean over the
  predicted tokens);
- `logits_sum`, `logits_first8` (logits[0][0][:8]), `logits_last8` (logits[-1][-1][-8:]);
- `grad_norms`: the L2 norm of each stored tensor's gradient, keyed by its name in the
  files (transformers 5 fuses MoE experts in memory; the norms are taken after its own
  save conversion, so they are keyed per expert as the files are);
- `greedy`: the greedy continuation (8 new tokens) of the first sequence's first 8 ids;
- the torch and transformers versions.

transformers computes RMSNorm, the RoPE tables, the attention softmax, the router and the
loss in float32 even in a float64 model, so the goldens are float32-accurate (about 1e-7
relative): compare against them at ~1e-5.

Every weight is drawn afresh (norm weights around 1, biases nonzero, matrices with a
spread wide enough that logits and greedy tokens are not near ties), so a loader that
skips or transposes a tensor changes the numbers. `qwen2` is stored as bfloat16 (its
goldens are computed from the rounded weights) to test the conversion; `mixtral` is saved
in shards with an index. `llama32` carries a byte-level BPE `tokenizer.json` trained on
data/tiny_corpus.txt, and `tokenizer_golden.json` (a text and its ids) for the tokenizer
load path.
"""
import json
import os
import shutil
import tempfile

import torch
import transformers
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig,
                          Qwen2Config, Qwen3Config, Qwen3MoeConfig)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "hf")
CORPUS = os.path.join(ROOT, "data", "tiny_corpus.txt")

SEQ = 24
BATCH = 2
# Every model's vocabulary holds at least this many tokens, so one ids.json serves all.
IDS_VOCAB = 128
TOKENIZER_VOCAB = 320

small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2)


def models(bos, eos):
    """name -> (config, stored dtype, max shard size or None); `bos` and `eos` are the
    trained tokenizer's special tokens, which the model that carries it names."""
    return {
        # Llama 2 style: grouped-query attention, untied head, plain RoPE.
        "llama": (LlamaConfig(**small, vocab_size=256, tie_word_embeddings=False),
                  torch.float32, None),
        # Llama 3.2 style: llama3 RoPE scaling (original 256 with factors 1 and 4 puts one
        # frequency of each kind, kept, blended and divided, among head_dim 16's eight),
        # tied embeddings, the trained tokenizer's vocabulary.
        "llama32": (LlamaConfig(
            **{**small, "hidden_size": 64, "intermediate_size": 96, "bos_token_id": bos,
               "max_position_embeddings": 2048,
               "eos_token_id": eos},
            vocab_size=TOKENIZER_VOCAB, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256}),
            torch.float32, None),
        # A window smaller than the sequence, so it masks something.
        "mistral": (MistralConfig(**small, vocab_size=192, sliding_window=8,
                                  tie_word_embeddings=False), torch.float32, None),
        "qwen2": (Qwen2Config(**small, vocab_size=160, tie_word_embeddings=False),
                  torch.bfloat16, None),
        # head_dim 16 with hidden 32 and 4 heads: q_proj is [64, 32].
        "qwen3": (Qwen3Config(**small, vocab_size=144, head_dim=16, tie_word_embeddings=False),
                  torch.float32, None),
        "mixtral": (MixtralConfig(**{**small, "intermediate_size": 48}, vocab_size=128,
                                  num_local_experts=4, num_experts_per_tok=2,
                                  tie_word_embeddings=False),
                    torch.float32, "100KB"),
        "qwen3_moe": (Qwen3MoeConfig(**small, vocab_size=136, head_dim=16, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=24,
                                     norm_topk_prob=True, tie_word_embeddings=False),
                      torch.float32, None),
    }


def randomize(model, seed):
    """Fresh weights with no structure a wrong loader could get right by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            else:
                # Fan-in scaling: inputs are along the last dim of every stored matrix.
                fan_in = p.shape[-1]
                p.copy_(noise * (1.5 / fan_in ** 0.5))


def stored_names(model, tmp):
    """The names and gradient norms of the stored tensors, through transformers' own save
    conversion (experts fused in memory are written one per expert)."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.copy_(grads[n])
    model.save_pretrained(tmp, safe_serialization=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    norms = {}
    for f in sorted(os.listdir(tmp)):
        if f.endswith(".safetensors"):
            for name, t in load_file(os.path.join(tmp, f)).items():
                norms[name] = t.double().norm().item()
    return dict(sorted(norms.items()))


def greedy(model, prompt, new):
    """Greedy continuation by full forwards (no cache), checked against generate(); each
    step's winner must lead the runner-up clearly, or a float32-accurate reimplementation
    could pick another token."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(new):
            last = model(ids).logits[0, -1]
            top = last.topk(2).values
            assert top[0] - top[1] > 1e-3, f"near tie in greedy step: {top.tolist()}"
            ids = torch.cat([ids, last.argmax().view(1, 1)], dim=1)
        out = model.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=0,
                             eos_token_id=None, pad_token_id=0)
    manual = ids[0, prompt.shape[1]:].tolist()
    generated = out[0, prompt.shape[1]:].tolist()
    assert manual == generated, f"greedy by hand {manual} != generate {generated}"
    return manual


def train_tokenizer(path):
    """A byte-level BPE on the bundled corpus, set up as dtensor's Tokenizer::train_bpe
    sets it up (GPT-2 pre-tokenizer without prefix space, BOS prepended)."""
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, processors, trainers
    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, min_frequency=2,
                                  show_progress=False, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([CORPUS], trainer)
    bos = tok.token_to_id(specials[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{specials[0]} $A", pair=f"{specials[0]} $A {specials[0]} $B",
        special_tokens=[(specials[0], bos)])
    tok.save(path)
    assert tok.get_vocab_size(with_added_tokens=True) <= TOKENIZER_VOCAB
    return tok, bos, tok.token_to_id(specials[1])


def main():
    torch.manual_seed(0)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, IDS_VOCAB, (BATCH, SEQ), generator=g)
    with open(os.path.join(OUT, "ids.json"), "w") as f:
        json.dump({"input_ids": ids.tolist()}, f)
        f.write("\n")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    tok_file = os.path.join(OUT, "tokenizer.json")
    tok, bos, eos = train_tokenizer(tok_file)
    for seed, (name, (config, dtype, shard)) in enumerate(models(bos, eos).items()):
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                 experts_implementation="eager",
                                                 dtype=torch.float32)
        randomize(model, seed)
        d = os.path.join(OUT, name)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.to(dtype).save_pretrained(d, safe_serialization=True, **kwargs)
        # The goldens are those of the files as transformers reads them back: casting the
        # model in memory would round its RoPE frequency buffer too, which a load
        # recomputes.
        model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                     experts_implementation="eager",
                                                     dtype=torch.float64)
        model.eval()

        out = model(ids, labels=ids)
        out.loss.backward()
        logits = out.logits.detach()
        with tempfile.TemporaryDirectory() as tmp:
            norms = stored_names(model, tmp)
        model.zero_grad()
        golden = {
            "loss": out.loss.item(),
            "logits_sum": logits.sum().item(),
            "logits_first8": logits[0, 0, :8].tolist(),
            "logits_last8": logits[-1, -1, -8:].tolist(),
            "grad_norms": norms,
            "greedy": greedy(model, ids[:1, :8], 8),
            "greedy_prompt": ids[0, :8].tolist(),
            "stored_dtype": str(dtype).removeprefix("torch."),
            "versions": versions,
        }
        with open(os.path.join(d, "golden.json"), "w") as f:
            json.dump(golden, f, indent=1)
            f.write("\n")
        print(f"{name}: loss {golden['loss']:.6f}, {len(norms)} tensors, greedy {golden['greedy']}")

    tok_dir = os.path.join(OUT, "llama32")
    shutil.move(tok_file, os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
        f.write("\n")
    text = "The keeper climbed the stairs before the sun, and counted them: 112 steps."
    with open(os.path.join(tok_dir, "tokenizer_golden.json"), "w") as f:
        json.dump({"text": text, "ids": tok.encode(text).ids,
                   "ids_without_specials": tok.encode(text, add_special_tokens=False).ids,
                   "bos_id": bos, "eos_id": eos, "vocab_size": tok.get_vocab_size(True)},
                  f, indent=1)
        f.write("\n")

    total = 0
    for dirpath, _, files in os.walk(OUT):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    print(f"{OUT}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
