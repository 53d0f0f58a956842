"""LoRA adapters on real vLLM (its CPU build) as a user serves them: a daemon with one `backend:
vllm` engine of tiny-llama (engine_args.enable_lora), a real PEFT adapter (testkit.lora) loaded
through the gateway (`POST /v1/load_lora_adapter`, vLLM's shape), asked for by name with the
official `openai` client. Its greedy answer differs from the base model's and is the same every
time: after a SIGKILL of the engine (the restart loads it before READY) and after an
`enginectl upgrade` (the same engine, adopted). One daemon, one engine: each vLLM start costs
seconds, so the whole story is one test with two vLLM starts (the first and the restart).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import openai
import pytest

from testkit.driver import free_port, running_daemon
from testkit.lora import make_tiny_llama_adapter
from testkit.probes import http_text

pytestmark = pytest.mark.vllm

READY_TIMEOUT_S = 180.0
PROMPT = "hello there"


def test_a_loaded_adapter_answers_its_own_way_across_a_kill_and_an_upgrade(
        vllm_python: str, tiny_cache: Path, tiny_checkpoint: Path,
        tmp_path_factory: pytest.TempPathFactory):
    adapter = make_tiny_llama_adapter(tmp_path_factory.mktemp("lora") / "one", tiny_checkpoint,
                                      seed=1)
    engine = {"name": "vllm", "model": "builtin:tiny-llama", "backend": "vllm",
              "python": vllm_python, "threads": 1, "max_batch_size": 8,
              "startup_timeout": "5m", "stall_timeout": "60s",
              "engine_args": {"enforce_eager": True, "max_model_len": 1024,
                              "enable_lora": True},
              "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "ENGINED_CACHE_DIR": str(tiny_cache)}}
    gateway = free_port()
    with running_daemon([engine], {"gateway": f"127.0.0.1:{gateway}",
                                   "heartbeat_interval": "0.2s", "heartbeat_timeout": "5s"},
                        {"backoff": {"initial": "0s", "jitter": 0}}, prefix="egl") as d:
        d.wait_all_ready(READY_TIMEOUT_S)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="none",
                               max_retries=0, timeout=120)

        def greedy(model: str) -> str:
            done = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                             temperature=0)
            assert done.usage.completion_tokens > 0, done
            return done.choices[0].text

        base = greedy("vllm")
        assert _post_to(gateway, "/v1/load_lora_adapter", {"lora_name": "one",
                                                        "lora_path": str(adapter)}) == (
            200, "Success: LoRA adapter 'one' added successfully.")
        models = {m.id: m.model_dump() for m in client.models.list()}
        assert models["one"]["parent"] == "vllm", models
        one = greedy("one")
        assert one != base, (one, base)
        assert [greedy("one"), greedy("vllm"), greedy("one")] == [one, base, one]

        victim = d.engine("vllm-0")["pid"]
        os.kill(victim, signal.SIGKILL)
        d.wait_restarted("vllm-0", victim, READY_TIMEOUT_S)
        assert greedy("one") == one and greedy("vllm") == base

        before = d.engine("vllm-0")
        done = d.ctl("upgrade")
        assert done.returncode == 0, done.stderr
        d.wait_all_ready(READY_TIMEOUT_S)
        after = d.engine("vllm-0")
        assert (after["pid"], after["incarnation"]) == (before["pid"], before["incarnation"])
        assert after["adopted_at"], after
        assert greedy("one") == one and greedy("vllm") == base

        assert _post_to(gateway, "/v1/unload_lora_adapter", {"lora_name": "one"})[0] == 200
        with pytest.raises(openai.NotFoundError):
            greedy("one")
        assert greedy("vllm") == base


def _post_to(port: int, route: str, body: dict[str, Any]) -> tuple[int, str]:
    return http_text("POST", f"http://127.0.0.1:{port}{route}", body, timeout_s=120)
