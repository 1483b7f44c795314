"""The start-up warm-up's token counts reach every kernel shape a step can take: for each token count up to the
step budget, some warm-up size has the same LoRA kernel shapes (shrink and expand configs), the same LoRA path
(the side stream's scratch, or the eager kernels past it) and the same parity (Triton specializes integers on
whether 16 divides them, and some LoRA arguments are the token count times 8 or 24)."""
from types import SimpleNamespace

import pytest
import torch

from loraserve.kernels.fused import SiluLoRAConfig
from loraserve.kernels.lora_expand import expand_config, pipelined_shape
from loraserve.kernels.lora_shrink import shrink_config
from loraserve.lora.runtime import LoRARuntime
from loraserve.lora.side_stream import SIDE_STREAM_MAX_TOKENS
from loraserve.worker.model_runner import ModelRunner, warm_up_sizes

HIDDEN_SR = ((4096, 24), (4096, 8), (4096, 16), (14336, 8), (2048, 48))  # Llama-3 q/k/v, o, gate/up, down at rank 8


def shapes(num_tokens: int) -> tuple:
    return (tuple(shrink_config(num_tokens, hidden, sr) for hidden, sr in HIDDEN_SR), expand_config(num_tokens),
            num_tokens <= SIDE_STREAM_MAX_TOKENS, num_tokens % 2)


@pytest.mark.parametrize("budget", [8192, 2048, 4000, 700, 512, 300, 64, 20])
def test_warm_up_reaches_every_shape_of_a_step(budget):
    sizes = warm_up_sizes(budget)
    assert sizes == sorted(set(sizes)) and sizes[-1] == budget and all(0 < n <= budget for n in sizes)
    warmed = {shapes(n) for n in sizes}
    missing = [n for n in range(min(32, budget), budget + 1) if shapes(n) not in warmed]
    assert not missing, f"token counts whose kernel shapes no warm-up pass compiles: {missing[:10]}"


def test_warm_up_stays_small():
    assert len(warm_up_sizes(8192)) <= 3 * 9 + 1  # three passes per power of two from 32 at most


@pytest.mark.parametrize("rank_width", [8, 16, 24, 64, 72, 128])
def test_expand_widths_give_every_dot_shape_of_the_factors(rank_width):
    """LoRARuntime.expand_widths: one width for each kernel shape silu_and_mul's dot can take for a step whose
    largest rank is 1..rank_width (LoRAFactors.dot_width through lora_expand.pipelined_shape)."""
    runtime = SimpleNamespace(pool=SimpleNamespace(rank_width=rank_width))
    widths = LoRARuntime.expand_widths(runtime)
    stages = SiluLoRAConfig().col_stages
    assert {pipelined_shape(stages, 16, w) for w in widths} == \
        {pipelined_shape(stages, 16, w) for w in range(1, rank_width + 1)}


@pytest.mark.parametrize("overflow", [True, False])
def test_warm_up_compiles_each_dot_width_once_past_the_scratch(overflow):
    """Past the side stream's scratch, the first warm-up size runs once more per dot width (LoRABatch.step_rank);
    later sizes once more without the GEMMs' columns where a step's adapters can overflow them, else not."""
    passes = []

    def forward_eager(inputs, every_lora_layer=False, lora_in_gemms=True, lora_step_rank=None):
        passes.append((len(inputs.input_ids), lora_in_gemms, lora_step_rank))

    lora = SimpleNamespace(side=SimpleNamespace(scratch=SimpleNamespace(max_tokens=512)), factors_may_run=True,
                           columns_may_overflow=overflow, expand_widths=lambda: (16, 32, 64))
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=2048),
                             model=SimpleNamespace(max_model_len=4096))
    runner = SimpleNamespace(config=config, lora=lora, dummy_block=0, block_size=16, device=torch.device("cpu"),
                             model=SimpleNamespace(compute_logits=lambda hidden: None), forward_eager=forward_eager)
    ModelRunner.warm_up_eager(runner)
    sizes = warm_up_sizes(2048)
    larger = [n for n in sizes if n > 512]
    expected = []
    for n in sizes:
        expected.append((n, True, None))
        if n == larger[0]:
            expected += [(n, False, w) for w in (16, 32, 64)]
        elif n > 512 and overflow:
            expected.append((n, False, None))
    assert passes == expected
