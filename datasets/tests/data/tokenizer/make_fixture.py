"""Writes a small Llama-3-style byte-level BPE tokenizer (tokenizer.json,
tokenizer_config.json) trained by the Python `tokenizers` bindings on the bundled corpus,
and goldens.json: the ids transformers' `AutoTokenizer` gives for a few texts, with and
without special tokens, and its decoding. datasets/tests/tokenizer.rs checks that
dtensor's Tokenizer gives the same. Run in a scratch virtual environment with transformers
installed (never a dependency of the project):

    python make_fixture.py   # from this directory
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

here = os.path.dirname(os.path.abspath(__file__))
corpus = os.path.join(here, "../../../../data/tiny_corpus.txt")
bos, eos = "<|begin_of_text|>", "<|end_of_text|>"

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=320, min_frequency=2, special_tokens=[bos, eos],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
tok.train([corpus], trainer)
tok.post_processor = processors.TemplateProcessing(
    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
tok.save(os.path.join(here, "tokenizer.json"))
with open(os.path.join(here, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": bos, "eos_token": {"__type": "AddedToken", "content": eos, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True},
               "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)

hf = AutoTokenizer.from_pretrained(here)
texts = ["Hello, world!", "  two  spaces and a tab\there", "ünïcödé → ✓ 日本語",
         "The quick brown fox jumps over the lazy dog.\n\nNew paragraph."]
goldens = [{
    "text": t,
    "with_special": hf(t)["input_ids"],
    "without_special": hf(t, add_special_tokens=False)["input_ids"],
    "decoded": hf.decode(hf(t)["input_ids"], skip_special_tokens=True),
} for t in texts]
with open(os.path.join(here, "goldens.json"), "w") as f:
    json.dump({"bos_id": hf.bos_token_id, "eos_id": hf.eos_token_id,
               "vocab_size": len(hf), "cases": goldens}, f, indent=1, ensure_ascii=False)
