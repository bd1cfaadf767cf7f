"""xgrammar vs llguidance on the embedded model's tokenizer (``python -m bench.grammar_libs``).

The choice of the grammar library headrace's constrained decoding uses rests on these numbers:
for each library, the tokenizer's one-off preparation, each test schema's compile time (cold:
no cache), and the time to fill the next-token bitmask per step at batch 1 and batch 32,
along a real token sequence that satisfies the schema (a JSON instance, tokenized). Both run
on the same thread count (``--threads``); writes ``bench/results/grammar-libs-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.common import load_average, publish
from compute.loaders.default_model import default_model_path
from compute.tokenizer.tokenizer import Tokenizer
from tests.support.schemas import SCHEMAS

# Both libraries emit compact JSON (no whitespace), so both walk the same token sequences.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

INSTANCES = {
    "person": {"name": "Ada Lovelace", "age": 36, "role": "admin"},
    "order": {
        "order_id": "AB1234",
        "customer": {"name": "Grace Hopper", "address": {"city": "Arlington", "zip": "22201"}},
        "items": [{"sku": "KB-101", "quantity": 2}, {"sku": "MS-7", "quantity": 1}],
        "express": True,
    },
    "weather_tool": {"location": "Paris, France", "unit": "celsius", "days": 3},
    "wide40": None,  # filled from the schema
}


def _wide_instance(schema: dict) -> dict:
    values = {"string": "abc", "integer": 7, "number": 1.5, "boolean": False}
    return {
        k: (v["enum"][0] if "enum" in v else values[v["type"]])
        for k, v in schema["properties"].items()
    }


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, threads: int) -> None:
        import transformers
        import xgrammar as xgr

        self.xgr = xgr
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
        self.info = xgr.TokenizerInfo.from_huggingface(
            fast, vocab_size=tok.vocab_size, stop_token_ids=list(tok.eos_token_ids)
        )
        self.threads = threads

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def consume(self, matcher, token: int) -> None:
        assert matcher.accept_token(token), token


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, threads: int) -> None:
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(
            tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids[0]
        )
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        ll = self.ll
        grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
        matcher = ll.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, bitmask) -> None:
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def consume(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


def _mask_times(lib, compiled, tokens: list[int], batch: int, vocab: int) -> list[float]:
    """Seconds per step to fill ``batch`` rows of the bitmask, along ``tokens``."""
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    times = []
    for token in tokens:
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        times.append(time.perf_counter() - t0)
        for m in matchers:
            lib.consume(m, token)
    return times


def run_library(lib_cls, tok: Tokenizer, threads: int, reps: int) -> dict:
    t0 = time.perf_counter()
    lib = lib_cls(tok, threads)
    result: dict = {"tokenizer_setup_s": time.perf_counter() - t0, "schemas": {}}
    for name, schema in SCHEMAS.items():
        instance = INSTANCES[name] or _wide_instance(schema)
        tokens = tok.encode(json.dumps(instance, separators=(",", ":")))
        compile_s = []
        for _ in range(reps):
            t0 = time.perf_counter()
            compiled = lib.compile(schema)
            compile_s.append(time.perf_counter() - t0)
        entry = {"compile_s_median": statistics.median(compile_s), "compile_s": compile_s}
        entry["tokens"] = len(tokens)
        for batch in (1, 32):
            steps = []
            for _ in range(reps):
                steps += _mask_times(lib, compiled, tokens, batch, tok.vocab_size)
            entry[f"mask_s_per_step_b{batch}_median"] = statistics.median(steps)
            entry[f"mask_s_per_step_b{batch}_p90"] = statistics.quantiles(steps, n=10)[-1]
        result["schemas"][name] = entry
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="library and torch threads")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per measurement")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_gguf(default_model_path())
    load_start = load_average()
    libraries = {
        lib.name: run_library(lib, tok, args.threads, args.reps) for lib in (XGrammar, LLGuidance)
    }
    payload = {
        "vocab_size": tok.vocab_size,
        "libraries": libraries,
        "load_average_start": load_start,
        "load_average_end": load_average(),
    }
    for name, lib in libraries.items():
        print(name, f"tokenizer setup {lib['tokenizer_setup_s']:.3f} s")
        for schema, e in lib["schemas"].items():
            print(
                f"  {schema:13s} compile {e['compile_s_median'] * 1e3:8.2f} ms  mask/step "
                f"b1 {e['mask_s_per_step_b1_median'] * 1e6:8.1f} us  "
                f"b32 {e['mask_s_per_step_b32_median'] * 1e6:8.1f} us"
            )
    publish("grammar-libs", payload, settings=vars(args))


if __name__ == "__main__":
    main()
