"""The start-up warm-up's token counts reach every kernel shape a step can take: for each token count up to the
step budget, some warm-up size has the same LoRA kernel shapes (shrink and expand configs), the same LoRA path
(the side stream's scratch, or the eager kernels past it) and the same parity (Triton specializes integers on
whether 16 divides them, and some LoRA arguments are the token count times 8 or 24)."""
import pytest

from loraserve.kernels.lora_expand import expand_config
from loraserve.kernels.lora_shrink import shrink_config
from loraserve.lora.side_stream import SIDE_STREAM_MAX_TOKENS
from loraserve.worker.model_runner import warm_up_sizes

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
