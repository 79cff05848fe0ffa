"""Entry-point targets only: the functions vLLM (`vllm.general_plugins`) and SGLang
(`sglang.srt.plugins`) call to install Warply; the plugins themselves live in `vllm_connector`
and `sglang_hook`."""
