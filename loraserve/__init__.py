"""loraserve: serve many LoRA fine-tunes of one base model, with LoRA inside the CUDA graphs."""
from loraserve.entrypoints.llm import LLM
from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
