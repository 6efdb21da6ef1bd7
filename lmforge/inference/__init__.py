"""The inference server evaluation and serving share: vLLM's OpenAI server and its settings
(`vllm_server`), the guard in front of every server (`vllm_guard`: the key, bounded requests,
draining), and vLLM's CPU plugin (`vllm_amx`)."""
