"""The inference engine: one model, continuous batching over a paged KV cache.

The nouns of the loop, one module each (as nano-vllm names them):
`sequence` (a request's tokens and state), `block_manager` (paged KV blocks, prefix
cache), `scheduler` (who runs this step, within the token budget; preemption),
`model_runner` (tensors in, logits out), `sampler` (logits to tokens), `llm_engine`
(`step()` = schedule, run, postprocess), `async_engine` (the engine on its own thread
for servers), `llm` (the offline API shaped like vLLM's).
"""
