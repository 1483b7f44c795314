"""A random decode batch for the graph tests: n sequences over their own KV blocks, as StepInputs."""
import numpy as np

from loraserve.worker.step_inputs import StepInputs


def random_decode_inputs(rng: np.random.Generator, n: int, block_size: int, vocab: int,
                         token_slots=None) -> StepInputs:
    """n rows, each with two KV blocks of its own (2i, 2i+1) and a random length in [1, 2 * block_size);
    token_slots: LoRA slot per row (-1 = base), default all -1."""
    seq_lens = rng.integers(1, 2 * block_size, size=n).astype(np.int32)
    tables = np.stack([np.arange(2 * i, 2 * i + 2) for i in range(n)]).astype(np.int32)
    positions = (seq_lens - 1).astype(np.int64)
    slots = tables[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
    lora = np.full(n, -1, np.int32) if token_slots is None else np.asarray(token_slots, np.int32)
    return StepInputs(rng.integers(0, vocab, size=n).astype(np.int64), positions, slots, tables, seq_lens,
                      np.arange(n + 1, dtype=np.int32), lora, np.arange(n, dtype=np.int64), 1)
