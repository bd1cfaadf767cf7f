"""One row through every weight of the model, a K-quant file against the Q4_1 file.

A decode step reads every weight once; this times exactly that part of it (the projections
of all layers in a step's order, then the lm_head) with one input row, for each file and
--weights mode (``quantized``: the exact kernel on the file's blocks; ``quantized-int8``:
the int8 kernel on kernels/cpu/quant.py for_int8's formats; ``quantized-int8, Q5_0/Q6_K as
Q8_0``: the same with every Q5_0 matrix widened to Q8_0 (exactly) and every Q6_K one
requantized to Q8_0 at load, as for_int8 did before the int8 kernel read them, for files
that have them; ``quantized-int8, Q4_K as Q4_1``: every Q4_K matrix converted to Q4_1 at
load, as for_int8 did before the int8 kernel read Q4_K; ``quantized-int8, IQ4 as Q8_0``:
every IQ4_NL / IQ4_XS matrix requantized to Q8_0 at load, as for_int8 did before the
int8 kernel read them). Reported: ms per pass, the
passes per second that bounds tokens/s, and the GB/s of weight bytes read, beside a plain
read of a large tensor (what this machine streams, same threads). The cases alternate
within each repetition (A/B interleaved): the machine is shared, so a busy spell hits all
of them alike. Also the idle RSS of each file's model loaded in blocks and dequantized
(a fresh process each, model built as the engine builds it).

Default files: the embedded SmolLM2 (Q4_1) and the same model requantized to Q4_K_M and
IQ4_XS by llama-quantize (bench/requantize.py; ``make llama-quantize`` first).
Run: ``python bench/kquant_pass.py``; writes bench/results/kquant-pass-<stamp>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import common
from compute.loaders import load_model
from compute.models.decoder import fuse
from kernels.cpu.library import use_torch_threads
from kernels.cpu.quant import FORMATS
from kernels.cpu.quant_linear import quant_linear

WIDENED = "quantized-int8, Q5_0/Q6_K as Q8_0"
AS_Q4_1 = "quantized-int8, Q4_K as Q4_1"
IQ4_AS_Q8_0 = "quantized-int8, IQ4 as Q8_0"
OLD_MODES = (WIDENED, AS_Q4_1, IQ4_AS_Q8_0)


def matrices(
    path: str, int8: bool, widen: bool = False, q4_1: bool = False, iq4: bool = False
) -> list:
    """Every projection of the file's model in a decode step's order, as the engine holds
    them (fused q|k|v and gate|up), then the lm_head. ``widen``: Q5_0 matrices as Q8_0
    (exactly: codes q - 16, the same d), Q6_K ones requantized to Q8_0; ``q4_1``: Q4_K
    matrices as Q4_1 (kernels/cpu/quant.py as_q4_1); ``iq4``: IQ4_NL and IQ4_XS matrices
    requantized to Q8_0."""
    q = load_model(path, quantized=True, progress=False).weights
    if iq4:
        old = (FORMATS["iq4_nl"], FORMATS["iq4_xs"])
        q = {k: w.as_q8_0() if getattr(w, "format", None) in old else w
             for k, w in q.items()}  # fmt: skip
    if q4_1:
        q = {k: w.as_q4_1() if getattr(w, "format", None) == FORMATS["q4_k"] else w
             for k, w in q.items()}  # fmt: skip
    if widen:
        old = (FORMATS["q5_0"], FORMATS["q6_k"])
        q = {k: w.as_q8_0() if getattr(w, "format", None) in old else w
             for k, w in q.items()}  # fmt: skip
    layers = 1 + max(int(k.split(".")[2]) for k in q if k.startswith("model.layers."))
    out = []
    for i in range(layers):
        p = f"model.layers.{i}."
        out.append(fuse([q[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"], int8))
        out.append(q[f"{p}self_attn.o_proj.weight"])
        out.append(fuse([q[f"{p}mlp.gate_proj.weight"], q[f"{p}mlp.up_proj.weight"]], int8))
        out.append(q[f"{p}mlp.down_proj.weight"])
    out.append(q.get("lm_head.weight", q["model.embed_tokens.weight"]))
    dense = [w for w in out if isinstance(w, torch.Tensor)]
    if dense:  # e.g. an F16 embedding: not a block format, left out of the pass
        print(f"{path}: {len(dense)} dense matrices left out")
        out = [w for w in out if not isinstance(w, torch.Tensor)]
    if int8:
        out = [w.for_int8().tiled() for w in out]
    return out


def stream_gb_s(threads: int, mib: int = 512) -> float:
    """Read bandwidth of a plain sum over a large tensor (best of 5)."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def rss_child(path: str, quantized: bool) -> None:
    from compute.device.memory_report import process_rss_bytes
    from compute.models.decoder import DecoderModel

    loaded = load_model(path, quantized=quantized, progress=False)
    model = DecoderModel(loaded.config, loaded.weights, native=True)
    loaded.weights.clear()
    gc.collect()
    print(json.dumps({"rss_mib": process_rss_bytes() / 2**20, "layers": len(model.layers)}))


def idle_rss(path: str, quantized: bool) -> float:
    cmd = [sys.executable, "-m", "bench.kquant_pass", "--rss-child", path,
           "--quantized", str(int(quantized))]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["rss_mib"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--files", nargs="*", help="GGUF files (default: SmolLM2 Q4_K_M, IQ4_XS, Q4_1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15, help="interleaved rounds (median)")
    p.add_argument("--passes", type=int, default=20, help="passes per case per round")
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    p.add_argument("--quantized", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    use_torch_threads()  # the kernels' OpenMP team: the same count
    if args.rss_child:
        return rss_child(args.rss_child, bool(args.quantized))
    if not args.files:
        from bench.requantize import requantized
        from compute.loaders.default_model import default_model_path

        made = [str(requantized(kind)) for kind in ("Q4_K_M", "IQ4_XS")]
        args.files = [*made, str(default_model_path())]
    cases = {}
    for path in args.files:
        for mode in ("quantized", "quantized-int8", *OLD_MODES):
            int8 = mode != "quantized"
            ws = matrices(
                path, int8, widen=mode == WIDENED, q4_1=mode == AS_Q4_1, iq4=mode == IQ4_AS_Q8_0
            )
            if mode in OLD_MODES and sum(w.nbytes for w in ws) == sum(
                w.nbytes for w in cases[(Path(path).name, "quantized-int8")][0]
            ):
                continue  # none of the formats this mode converts in this file
            xs = {w.cols: torch.randn(1, w.cols) for w in ws}
            cases[(Path(path).name, mode)] = (ws, xs, int8)
    samples: dict = {key: [] for key in cases}
    load = [common.load_average()]
    for _ in range(args.reps):  # A/B interleaved
        for key, (ws, xs, int8) in cases.items():
            t = time.perf_counter()
            for _ in range(args.passes):
                for w in ws:
                    quant_linear(xs[w.cols], w, int8=int8, check=False)
            samples[key].append((time.perf_counter() - t) / args.passes)
    load.append(common.load_average())
    rows = []
    for (name, mode), (ws, _, _) in cases.items():
        seconds = statistics.median(samples[(name, mode)])
        nbytes = sum(w.nbytes for w in ws)
        formats = sorted({f.format.name for w in ws for f in (w.parts or (w,))})
        rows.append({"file": name, "weights": mode, "formats": formats, "bytes": nbytes,
                     "ms": 1e3 * seconds, "passes_per_s": 1 / seconds,
                     "gb_s": nbytes / seconds / 1e9,
                     "ms_min": 1e3 * min(samples[(name, mode)])})  # fmt: skip
        print(f"{name:40s} {mode:33s} {nbytes / 1e6:6.1f} MB  {rows[-1]['ms']:6.2f} ms  "
              f"{rows[-1]['passes_per_s']:6.1f}/s  {rows[-1]['gb_s']:5.1f} GB/s")  # fmt: skip
    stream = stream_gb_s(args.threads)
    print(f"plain read of 512 MiB: {stream:.1f} GB/s")
    rss = []
    for path in args.files:
        for quantized in (True, False):
            mib = idle_rss(path, quantized)
            rss.append({"file": Path(path).name, "in_blocks": quantized, "rss_mib": mib})
            print(
                f"RSS {Path(path).name:40s} {'blocks' if quantized else 'dense':7s} {mib:.0f} MiB"
            )
    result = {"passes": rows, "stream_read_gb_s": stream, "idle_rss": rss,
              "load_average": load, "note": "2 shared cores, other jobs running; cases "
              "interleaved per round, medians"}  # fmt: skip
    print(f"wrote {common.write_result('kquant-pass', result, settings=vars(args))}")


if __name__ == "__main__":
    main()
