"""vLLM benchmark: engined's vLLM engines against the same LLMEngine driven directly and against
`vllm serve`, in one run (`python -m bench.vllm`; bench/README.md). Only the standard library
here: bench/vllm/worker.py runs under the vLLM interpreter and imports this package.

- `__main__`: the run, the summary of the targets;
- `engine`: what runs (the engine, `vllm serve`, the daemon), the interpreter, the environments;
- `direct`, `worker`: section 1, sustained load against the LLMEngine driven directly;
- `serving`, `serving_report`: section 2, vLLM's serving benchmark through the gateway and
  against `vllm serve`.
"""
