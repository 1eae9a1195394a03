"""sluice: an LLM serving stack, from the API key to the KV cache.

The offline API mirrors vLLM's so users know it::

    from sluice import LLM, SamplingParams
    llm = LLM()                      # the default model, SmolLM2-135M-Instruct
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16))

`LLM`, `SamplingParams` and `PoolingParams` are imported lazily so that `import sluice` stays cheap
for processes (router, gateway, bench) that never load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sluice.engine.llm import LLM
    from sluice.engine.pooling_params import PoolingParams
    from sluice.engine.sampling_params import SamplingParams

__all__ = ["LLM", "PoolingParams", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from sluice.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from sluice.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from sluice.engine.pooling_params import PoolingParams

        return PoolingParams
    raise AttributeError(name)
