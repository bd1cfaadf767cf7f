"""bench/kv_dtype.py on tiny settings: headrace per KV dtype in process, llama.cpp's rows
through a fake server (its real plumbing: tests/bench/test_bench_cpu_compare.py); no timing
is asserted."""

from __future__ import annotations

import json

from bench import common, kv_dtype
from bench.cpu_compare import llama


class FakeLlama:
    """LlamaSystem's interface: every token 10 ms apart, the first after 100 ms."""

    def __init__(self, binary, gguf, threads, slots, slot_ctx) -> None:
        self.args = (binary, gguf, threads, slots, slot_ctx)
        self.last_server = {"server_prompt_n": 0}
        self.runs: list[tuple[int, int]] = []

    def start(self, timeout, idle_wait) -> None:
        pass

    def run(self, prompt, new_tokens):
        self.runs.append((len(prompt), new_tokens))
        stamps = [100.1 + 0.01 * i for i in range(new_tokens)]
        return stamps, list(range(new_tokens)), 100.0

    def info(self) -> dict:
        return {"command": ["llama-server"], "slot_ctx": self.args[4]}

    def close(self) -> None:
        pass


def test_kv_dtype_dry_run_with_a_fake_llama_server(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    fakes: list[FakeLlama] = []
    monkeypatch.setattr(llama, "LlamaSystem", lambda *a: fakes.append(FakeLlama(*a)) or fakes[-1])
    monkeypatch.setattr(llama, "find_llama_server", lambda given: ("/bin/llama-server", ""))
    kv_dtype.main(["--configs", "quantized/float16,quantized-int8/int8", "--contexts", "40,72",
                   "--new-tokens", "3", "--name", "kvt"])  # fmt: skip
    [path] = tmp_path.glob("kvt-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    rows = result["rows"]
    systems = [(r["system"], r["kv_cache_dtype"], r["context"]) for r in rows]
    assert systems == [("headrace", "float16", 40), ("headrace", "float16", 72),
                       ("headrace", "int8", 40), ("headrace", "int8", 72),
                       ("llama.cpp", "f16", 40), ("llama.cpp", "f16", 72)]  # fmt: skip
    assert all(r["tokens"] == 3 for r in rows)
    # fp16 rows: 2 bytes x K and V x layers x KV heads x head dim; int8 about half of it.
    f16, i8 = rows[0]["kv_bytes_per_token"], rows[2]["kv_bytes_per_token"]
    assert f16 == 2 * 2 * 30 * 3 * 64 and i8 < 0.6 * f16
    # llama-server got the same prompts (and a 64-token warm-up first) in one slot.
    [fake] = fakes
    assert fake.runs == [(40, 4), (40, 3), (72, 3)]
    assert fake.args[3] == 1 and fake.args[4] >= 72 + 3
    assert round(rows[4]["ttft_s"], 6) == 0.1 and round(rows[4]["decode_tok_s"]) == 100
    assert set(result["vs_llama"]) == {"quantized / kv float16", "quantized-int8 / kv int8"}
    assert set(result["vs_llama"]["quantized / kv float16"]) == {"40", "72"}


def test_without_llama_server_headrace_alone() -> None:
    rows = [{"system": "headrace", "weights": "quantized", "kv_cache_dtype": "float16",
             "context": 8, "ttft_s": 1.0, "decode_tok_s": 50.0}]  # fmt: skip
    assert kv_dtype.ratios(rows) == {}
    rows.append({"system": "llama.cpp", "context": 8, "ttft_s": 2.0, "decode_tok_s": 40.0})
    assert kv_dtype.ratios(rows) == {
        "quantized / kv float16": {8: {"decode_vs_llama": 1.25, "ttft_sooner_than_llama": 2.0}}
    }
