"""Wire types shared by every process: OpenAI and Anthropic payloads, errors, KV events."""
