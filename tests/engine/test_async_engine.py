"""AsyncLLMEngine: streaming through the engine thread, aborts on close/cancel, queue limit, shutdown."""
from __future__ import annotations

import asyncio

import pytest

from loraserve.engine.async_engine import (AsyncLLMEngine, EngineClosedError, GenerationRequest, QueueFullError)
from loraserve.config import EngineArgs
from loraserve.engine.engine import LLMEngine
from loraserve.errors import InvalidRequestError, PromptTooLongError
from loraserve.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=100, ignore_eos=True)


@pytest.fixture
def llm(tiny_model_factory):
    return LLMEngine.from_args(EngineArgs(tiny_model_factory("llama"), device="cpu", max_num_seqs=4, max_model_len=128))


async def _idle_stats(engine: AsyncLLMEngine):
    for _ in range(200):
        stats = await engine.stats()
        if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine did not become idle: {stats}")


def test_generate_streams_and_closing_or_cancelling_aborts(llm):
    async def main():
        engine = AsyncLLMEngine(llm, max_waiting_requests=3)
        engine.start()
        try:
            outs = [o async for o in engine.generate("r1", "Hello", SamplingParams(max_tokens=4, temperature=0))]
            assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])

            stream = engine.generate("r2", "Hello", LONG)
            assert not (await stream.__anext__()).finished
            await stream.aclose()  # the consumer goes away: the request is aborted
            await _idle_stats(engine)

            async def consume():
                async for _ in engine.generate("r3", "Hello", LONG):
                    started.set()

            started = asyncio.Event()
            task = asyncio.ensure_future(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _idle_stats(engine)

            with pytest.raises(PromptTooLongError):
                await engine.add_requests([GenerationRequest("r4", [1] * 200, LONG)])
            group = [GenerationRequest(f"g{i}", "Hello", LONG) for i in range(4)]
            with pytest.raises(QueueFullError):  # 4 > max_waiting_requests: none of them is added
                await engine.add_requests(group)
            duplicate = [GenerationRequest("d", "Hello", LONG), GenerationRequest("d", "Hi", LONG)]
            with pytest.raises(InvalidRequestError):
                await engine.add_requests(duplicate)
            await _idle_stats(engine)
        finally:
            engine.shutdown(drain=False)

    asyncio.run(main())


def test_shutdown_drains_then_refuses(llm):
    async def main():
        engine = AsyncLLMEngine(llm)
        engine.start()
        stream = await engine.add_requests([GenerationRequest("a", "Hello", SamplingParams(max_tokens=30,
                                                                                           ignore_eos=True))])
        first = await stream.__anext__()
        stopping = asyncio.get_running_loop().run_in_executor(None, engine.shutdown, True)
        outs = [first] + [o async for o in stream]
        await stopping
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30
        assert not engine.is_alive()
        with pytest.raises(EngineClosedError):
            await engine.add_requests([GenerationRequest("b", "Hello", LONG)])

    asyncio.run(main())


def test_shutdown_without_drain_fails_streams(llm):
    async def main():
        engine = AsyncLLMEngine(llm)
        engine.start()
        stream = await engine.add_requests([GenerationRequest("a", "Hello", LONG)])
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, False)
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass
        assert not llm.has_unfinished_requests()

    asyncio.run(main())


def test_adapter_files_are_read_off_the_engine_thread(tiny_model_factory, tmp_path):
    """Reading an adapter happens on a worker thread while the engine thread keeps stepping."""
    import threading

    from model_fixtures import make_lora_adapters
    from loraserve.lora.request import LoRARequest

    folder = tiny_model_factory("llama")
    path = make_lora_adapters(folder, tmp_path, [{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}])[0]
    engine_core = LLMEngine.from_args(EngineArgs(folder, device="cpu", max_num_seqs=4, max_model_len=128,
                                                 enable_lora=True, max_lora_rank=8))
    load_threads, load_started, release = [], threading.Event(), threading.Event()
    original = engine_core.load_lora_weights

    def slow_load(request):
        load_threads.append(threading.current_thread())
        load_started.set()
        release.wait(10)  # held until the test has seen the engine make progress meanwhile
        return original(request)

    engine_core.load_lora_weights = slow_load

    async def main():
        engine = AsyncLLMEngine(engine_core)
        engine.start()
        try:
            adding = asyncio.ensure_future(engine.add_lora(LoRARequest("a", path)))
            await asyncio.to_thread(load_started.wait, 10)
            outs = [o async for o in engine.generate("r", "Hello", SamplingParams(max_tokens=3, temperature=0))]
            assert outs[-1].finished  # decoded to the end while the adapter was still loading
            assert not adding.done()
            release.set()
            await adding
            assert await engine.list_loras() == ["a"]
            assert load_threads[0] is not engine._thread
        finally:
            release.set()
            engine.shutdown()

    asyncio.run(main())
