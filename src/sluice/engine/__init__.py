"""The inference engine: one model, continuous batching over a paged KV cache.

The nouns of the loop, one module each (as nano-vllm names them):
`sequence` (a request's tokens and state), `block_manager` (paged KV blocks, prefix
cache), `scheduler` (who runs this step, within the token budget; preemption),
`model_runner` (tensors in, logits out), `sampler` (logits to tokens), `core`
(`step()` = schedule, run, sample: token ids only), `input_processor` /
`output_processor` (the front end's halves: checks and tokens in, text out),
`messages` + `core_client` (the core on a thread or in its own process), `llm_engine`
(core + text in one thread), `async_engine` (asyncio streams for servers), `llm` (the
offline API shaped like vLLM's).
"""
