"""The benchmark harness: pure helpers on hand-made data, and one tiny end-to-end run on the small real pair."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
import torch
import yaml

from benchmarks import analysis, bench, report
from benchmarks.meter import ForwardCall, cost_sizes
from benchmarks.methods import RunRecord, build_methods, hf_assistant_settings
from benchmarks.prompts import load_prompts
from benchmarks.serve_bench import RequestOptions, grpc_request, http_request, run_load, summarize_load
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc


def test_first_difference_finds_mismatch_prefix_and_equality():
    assert analysis.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert analysis.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert analysis.first_difference([1, 2, 3], [1, 2]) == 2


def test_geometric_mean_ignores_missing_values():
    assert analysis.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert analysis.geometric_mean([None, 4.0]) == pytest.approx(4.0)
    assert analysis.geometric_mean([]) is None


def test_build_methods_skips_sd_for_different_vocabularies_and_names_settings():
    names = [m.name for m in build_methods(["ar", "sd", "slem", "hf-assisted"], [3, 5], True, ["default", "3"],
                                           same_vocabulary=False)]
    assert names == ["ar", "slem/k3", "slem/k5", "slem/adaptive", "hf-assisted/default", "hf-assisted/k3"]
    same = [m.name for m in build_methods(["sd"], [4], False, [], same_vocabulary=True)]
    assert same == ["sd/k4"]
    with pytest.raises(ValueError, match="unknown algorithms"):
        build_methods(["medusa"], [3], False, [], same_vocabulary=False)
    lookups = build_methods(["ar", "slem"], [5], False, [], same_vocabulary=False, lookups=("off", "auto"),
                            lookup_min_matches=(4, 12))
    assert [m.name for m in lookups] == ["ar", "ar+lookup-auto/m4", "ar+lookup-auto/m12", "slem/k5",
                                         "slem/k5+lookup-auto/m4", "slem/k5+lookup-auto/m12"]
    assert [m.lookup_min_match for m in lookups] == [None, 4, 12, None, 4, 12]


def test_fixed_hf_draft_length_turns_off_the_confidence_stop():
    assert hf_assistant_settings("5") == {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant",
                                          "assistant_confidence_threshold": 0.0}
    assert hf_assistant_settings("default") == {}


def test_cost_sizes_cover_every_observed_forward():
    assert cost_sizes([1, 3, 6]) == [1, 2, 4, 6]
    assert cost_sizes([]) == [1]


def _record(method: str, seconds: float, target_tokens: list[int], drafter_tokens: list[int]) -> RunRecord:
    return RunRecord("p", method, method.split("/")[0], "-" if method == "ar" else "3", 10, [7] * 8, seconds,
                     [ForwardCall(tokens, 0.1) for tokens in target_tokens],
                     [ForwardCall(tokens, 0.01) for tokens in drafter_tokens])


def test_passes_are_priced_by_their_in_run_median_and_isolated_costs_only_fill_gaps():
    ar = _record("ar", 1.0, [10] + [1] * 7, [])
    assisted = _record("hf-assisted/k3", 0.8, [13, 4, 4, 4, 9], [10, 1, 1, 1])
    # one slow isolated sample of a 1-token pass must not make ar look dear (efficiency above 1)
    prices = analysis.pass_prices([ar, assisted], {"target": {1: 0.3, 2: 0.05, 8: 0.2}, "drafter": {1: 0.5}})
    assert prices["target"] == {1: 0.1, 2: 0.1, 4: 0.1, 8: 0.2}  # 9 seen once: not priced; 2 raised to 1's
    assert prices["drafter"] == {1: 0.01}
    speedups = analysis.per_prompt_speedups([ar, assisted], "ar", {"p": {"target": {1: 0.3}, "drafter": {1: 0.5}}})
    # ar: 0.1 + 7 * 0.1 = 0.8 s (not 0.1 + 7 * 0.3); assisted: 0.1 + 3 * 0.1 + 0.1 (9 tokens: past the priced
    # sizes, at the largest price) + 0.01 + 3 * 0.01 = 0.54 s
    assert speedups[("p", "hf-assisted/k3")]["ideal"] == pytest.approx(0.8 / 0.54)


def test_ideal_speedup_prices_passes_by_isolated_costs():
    ar = _record("ar", 1.0, [10] + [1] * 7, [])
    # transformers-style run: 4 passes of (prompt or last token) + 3 candidates, 1 accepted each time
    assisted = _record("hf-assisted/k3", 0.8, [13, 4, 4, 4], [10, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    costs = {"p": {"target": {1: 0.1, 4: 0.1}, "drafter": {1: 0.01}}}
    speedups = analysis.per_prompt_speedups([ar, assisted], "ar", costs)
    assert speedups[("p", "hf-assisted/k3")]["speedup"] == pytest.approx(1.25)
    # ar: 0.1 + 7 * 0.1 = 0.8 s; assisted: 0.1 + 3 * 0.1 + 0.01 + 9 * 0.01 = 0.5 s, same token count
    assert speedups[("p", "hf-assisted/k3")]["ideal"] == pytest.approx(1.6)
    assert analysis.draft_counts(assisted) == (12, 4)


def test_results_name_the_cpu_kernels_and_read_results_recorded_without_them(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(report, "native_bfloat16", lambda: False)
    assert report.cpu_kernels() == "AVX2, bf16: emulated"
    assert report.describe_machine({"cpu_model": "EPYC", "cpu_kernels": "AVX512, bf16: native",
                                    "cpu_cores": 2}) == "EPYC (AVX512, bf16: native), 2 cores"
    assert report.describe_machine({"cpu_model": "EPYC", "cpu_cores": 2}) == "EPYC, 2 cores"


def test_prompt_sets_have_the_requested_sizes():
    assert [case.prompt_id for case in load_prompts("humaneval", 2)] == ["HumanEval/0", "HumanEval/1"]
    assert [case.prompt_id for case in load_prompts("humaneval", 3, offset=1, stride=16)] == [
        "HumanEval/1", "HumanEval/17", "HumanEval/33"]
    summaries = load_prompts("summarization", 3)
    assert len(summaries) == 3 and all(case.text.endswith("Summary:") for case in summaries)
    long_context = load_prompts("longctx", 20)
    assert long_context and all(len(case.text) >= 9000 and "Question:" in case.text for case in long_context)
    with pytest.raises(ValueError, match="out of range"):
        load_prompts("humaneval", 1, offset=1000)


@pytest.mark.real
def test_bench_end_to_end_on_the_small_pair(tmp_path):
    """Every method on one prompt, 8 greedy float32 tokens: outputs written, all identical to ar."""
    threads = torch.get_num_threads()
    try:  # one thread: on a shared, busy CPU two threads per process stall each other (~10x slower)
        status = bench.main(["--pair", "small", "--task", "humaneval", "--num-prompts", "1", "--max-new-tokens", "8",
                             "--draft-tokens", "3",
                             "--algorithms", "ar,sd,slem,tli,slrs,hf-greedy,hf-assisted,hf-lookup", "--hf-drafts", "3",
                             "--lookup", "off", "always", "--lookup-min-match", "6", "--hf-lookup-tokens", "4",
                             "--warmup-tokens", "2",
                             "--cost-repeats", "1", "--threads", "1",
                             "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # load_model set it process-wide
    assert status == 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {row["method"]: row for row in result["summary"]}
    assert list(rows) == ["ar", "ar+lookup-always/m6", "slem/k3", "slem/k3+lookup-always/m6", "tli/k3",
                          "tli/k3+lookup-always/m6", "slrs/k3", "slrs/k3+lookup-always/m6", "hf-greedy",
                          "hf-assisted/k3", "hf-lookup/k4"]  # no sd: two vocabularies
    for name, row in rows.items():
        assert row["tokens"] == 8 and row["tokens_per_second"] > 0 and row["ms_per_token"] > 0
        assert row["speedup_vs_ar_median"] > 0 and row["speedup_vs_ar_geomean"] > 0
        assert row["ideal_speedup_geomean"] > 0 and row["efficiency_geomean"] > 0
        if name != "ar":
            assert row["output_identical_to_ar"] is True, row["divergences"]
    assert rows["ar"]["tokens_per_target_pass"] == 1.0 and rows["ar"]["acceptance_rate"] is None
    for name in ("slem/k3", "tli/k3", "slrs/k3", "hf-assisted/k3"):
        assert rows[name]["tokens_per_target_pass"] >= 1.0
        assert 0.0 <= rows[name]["acceptance_rate"] <= 1.0
        assert 0.0 < rows[name]["drafter_share"] < 1.0
    runs = result["runs"]
    assert {tuple(run["token_ids"]) for run in runs} == {tuple(runs[0]["token_ids"])}
    meta = result["meta"]
    assert meta["command"].endswith(f"--out {tmp_path}") and meta["git_commit"]
    assert meta["machine"]["cpu_cores"] >= 1 and meta["machine"]["torch_threads"] >= 1 and meta["date"]
    assert result["headline"]["best_hetspec"] in rows
    assert result["headline"]["best_hf"] in ("hf-assisted/k3", "hf-lookup/k4")
    assert rows["ar+lookup-always/m6"]["lookup"] == "always" and rows["hf-lookup/k4"]["lookup"] == "hf"
    assert result["settings"]["lookup_min_match"] == [6]
    assert set(result["pass_costs"]["HumanEval/0"]) == {"target", "drafter"}
    markdown = (tmp_path / "results.md").read_text()
    assert "| slrs/k3 |" in markdown and meta["git_commit"] in markdown
    assert f"({meta['machine']['cpu_kernels']})" in markdown  # the same model's prices differ by the kernels
    for name in ("speedup.png", "acceptance.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.real
def test_headline_writes_the_single_request_row_with_its_peers(tmp_path):
    """benchmarks/headline.py on the small pair, one prompt, 8 tokens: the target alone, hetspec, transformers'
    assisted generation and llama.cpp on the target's GGUF (or, without llama-cpp-python, a message saying it
    was skipped) in one table."""
    from benchmarks import headline, llama_peer

    threads = torch.get_num_threads()
    try:
        status = headline.main(["--pair", "small", "--num-prompts", "1", "--max-new-tokens", "8", "--threads", "1",
                                "--no-served", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # load_model set it process-wide
    assert status == 0
    result = json.loads((tmp_path / "headline.json").read_text())
    single = result["single"]
    assert single["target_alone"]["method"] == "ar" and single["target_alone"]["speedup"] == 1.0
    assert single["hetspec"]["method"] == "slem/k3" and single["transformers"]["method"] == "hf-assisted/k3"
    assert single["same_tokens_as_target_alone"] is True and result["served"] == []
    table = (tmp_path / "headline.md").read_text()
    assert "| hardware | load | target alone | hetspec | transformers | llama.cpp | result |" in table
    assert (tmp_path / "single" / "results.json").exists()
    if llama_peer.available():
        assert single["llama_cpp"]["tokens_per_second"] > 0 and single["llama_cpp_skipped"] is None
        bench_result = json.loads((tmp_path / "single" / "results.json").read_text())
        assert bench_result["peers"]["settings"]["llama.cpp"]["gguf"] == "gemma-3-270m-q4_k_m.gguf"
    else:
        assert single["llama_cpp"] is None and "llama-cpp-python is not installed" in single["llama_cpp_skipped"]
        assert "llama-cpp-python is not installed" in table


def test_without_llama_cpp_python_the_peer_is_skipped_with_the_install_command(monkeypatch, capsys):
    from types import SimpleNamespace

    from benchmarks import llama_peer

    monkeypatch.setattr(llama_peer, "available", lambda: False)
    peers, skipped = bench.make_peers(SimpleNamespace(llama_cpp=True), "gemma3-270m", None, greedy=True)
    assert peers == [] and 'pip install -e ".[bench-llama]"' in skipped and skipped in capsys.readouterr().err
    with pytest.raises(SystemExit, match="greedily only"):
        bench.make_peers(SimpleNamespace(llama_cpp=True), "gemma3-270m", None, greedy=False)
    with pytest.raises(ValueError, match="GGUF"):
        llama_peer.gguf_of("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_llama_peer_summary_compares_each_prompt_with_the_target_alone():
    from benchmarks.llama_peer import PeerRun, summarize_peer

    reference = {"a": ([1, 2, 3, 4], 2.0), "b": ([5, 6], 1.0)}  # ar: 2 tokens/s on both prompts
    runs = [PeerRun("a", "llama.cpp", [1, 2, 3, 4], 1.0), PeerRun("b", "llama.cpp", [5, 7], 0.25)]
    row = summarize_peer(runs, reference)
    assert row["tokens"] == 6 and row["tokens_per_second"] == 6 / 1.25
    assert row["speedup_vs_ar_median"] == 3.0 and abs(row["speedup_vs_ar_geomean"] - 8 ** 0.5) < 1e-12
    assert row["prompts_same_as_ar"] == 1


def test_headline_reads_the_served_levels_of_a_serve_scaling_result():
    from benchmarks.headline import markdown, served_rows

    result = {"settings": {"concurrency": [1, 8], "max_new_tokens": 64},
              "methods": {"served-grpc": {"1": {"tokens_per_second": 5.5}, "8": {"tokens_per_second": 20.3}},
                          "served-ar-grpc": {"1": {"tokens_per_second": 3.4}, "8": {"tokens_per_second": 19.5}},
                          "hf-batched": {"1": {"tokens_per_second": 3.5}, "8": {"tokens_per_second": 20.2}},
                          "llama.cpp-batched": {"1": {"tokens_per_second": 13.0}, "8": {"tokens_per_second": 36.0}}}}
    rows = served_rows(result)
    assert [row["hetspec"] for row in rows] == [5.5, 20.3] and rows[1]["transformers"] == 20.2
    assert [row["llama_cpp"] for row in rows] == [13.0, 36.0]
    assert rows[0]["load"].startswith("served, 1 client ") and rows[1]["load"].startswith("served, 8 clients ")
    cell = {"method": "ar", "tokens_per_second": 3.5, "speedup": 1.0}
    single = {"load": "1 request", "target_alone": cell, "hetspec": {**cell, "method": "slem/k9", "speedup": 2.26},
              "transformers": None, "llama_cpp": None, "llama_cpp_skipped": None, "same_tokens_as_target_alone": True}
    table = markdown({"pair": "p", "machine": "m", "date": "d", "commit": "c", "command": "x", "single": single,
                      "served": rows})
    assert "| m | 1 request | 3.50 | 3.50 (2.26x) | - | - | single/results.md |" in table
    assert ("| m | served, 8 clients (closed loop, 64 tokens) | 19.50 (server, speculation off) | 20.30 | "
            "20.20 (padded batch) | 36.00 (batched) | served/README.md |") in table


def test_llama_cpp_decodes_a_batch_of_sequences_as_it_decodes_each_alone():
    """The served benchmark's llama.cpp peer (one llama_decode a step for every running sequence) gives each
    prompt the tokens llama.cpp gives it alone, the sequences of other lengths and early ends beside it."""
    from benchmarks import llama_peer
    from benchmarks.prompts import load_prompts

    if not llama_peer.available():
        pytest.skip(llama_peer.INSTALL_HINT)
    peer = llama_peer.LlamaCppPeer(llama_peer.gguf_of("gemma3-270m"), 1, set())
    prompts = [peer.llm.tokenize(case.text.encode(), add_bos=True) for case in load_prompts("humaneval", 3)]
    alone = [peer.generate(ids, 6) for ids in prompts]
    batch = llama_peer.LlamaCppBatch(peer, 3, max(map(len, prompts)) + 8)
    try:
        assert batch.generate(prompts, 6) == alone
        assert batch.generate(prompts[:1], 2) == [alone[0][:2]]  # fewer sequences, the memory cleared between calls
        with pytest.raises(ValueError):
            batch.generate(prompts + prompts[:1], 6)
    finally:
        batch.close()


class _FakeHetSpec(hetspec_pb2_grpc.HetSpecServicer):
    """A gRPC servicer that streams 2 + 2 + 2 + 1 tokens and remembers the requests it got."""

    def __init__(self):
        self.requests = []

    async def GenerateStream(self, request, context):  # noqa: N802 -- the proto's method name
        self.requests.append(request)
        for _ in range(3):
            await asyncio.sleep(0.005)
            yield pb.GenerateResponse(text="ab", token_ids=[1, 2])
        yield pb.GenerateResponse(token_ids=[3], finish_reason="length",
                                  stats=pb.SpeculationStats(acceptance_rate=0.5, mean_accepted_per_pass=2.0))


def test_serve_bench_grpc_clients_measure_streamed_tokens():
    options = RequestOptions(max_new_tokens=7, algorithm="slem", draft_tokens=4, pipelined=False)

    async def scenario():
        fake = _FakeHetSpec()
        server = grpc.aio.server()
        hetspec_pb2_grpc.add_HetSpecServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = hetspec_pb2_grpc.HetSpecStub(channel)
                timings, wall = await run_load(lambda pid, text: grpc_request(stub, None, pid, text, options),
                                               [("a", "def f():"), ("b", "def g():")], concurrency=2,
                                               total_requests=5)
        finally:
            await server.stop(None)
        return fake, timings, wall

    fake, timings, wall = asyncio.run(scenario())
    assert len(timings) == 5 and sorted(t.prompt_id for t in timings) == ["a", "a", "a", "b", "b"]
    for timing in timings:
        assert timing.error is None and timing.tokens == 7 and timing.first_token_seconds > 0
        assert len(timing.token_latencies) == 5  # every token after the first chunk's two
        # a chunk's whole gap, where the latencies spread it over its tokens
        assert timing.longest_gap_seconds >= 2 * max(timing.token_latencies[:2]) > 0
        assert timing.stats["acceptance_rate"] == 0.5
    sent = fake.requests[0]
    assert (sent.max_new_tokens, sent.algorithm, sent.draft_tokens) == (7, "slem", 4)
    assert sent.HasField("pipelined") and sent.pipelined is False
    level = summarize_load("grpc", 2, timings, wall)
    assert level["errors"] == 0 and level["output_tokens"] == 35 and level["tokens_per_second"] > 0
    assert level["ttft_ms"]["p50"] > 0 and level["tpot_ms"]["p99"] >= level["tpot_ms"]["p50"]
    assert level["acceptance_rate"] == 0.5 and level["tokens_per_target_pass"] == 2.0
    assert level["longest_gap_ms"] == max(timing.longest_gap_seconds for timing in timings) * 1000


def test_serve_bench_http_client_parses_openai_stream_and_errors():
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if sent[-1]["prompt"] == "bad":
            return httpx.Response(400, json={"error": {"message": "max_tokens: too large"}})
        chunks = [{"choices": [{"text": "ab"}], "hetspec": {"token_ids": [1, 2]}},
                  {"choices": [{"text": "c", "finish_reason": "stop"}],
                   "hetspec": {"token_ids": [3], "stats": {"acceptance_rate": 0.25}}},
                  {"choices": [], "usage": {"completion_tokens": 3}}]
        body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def scenario():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            options = RequestOptions(max_new_tokens=3, algorithm="tli", pipelined=True)
            return (await http_request(client, "m", "p", "def f():", options),
                    await http_request(client, "m", "q", "bad", options))

    good, bad = asyncio.run(scenario())
    assert good.error is None and good.tokens == 3 and good.stats == {"acceptance_rate": 0.25}
    assert len(good.token_latencies) == 1
    assert sent[0]["stream"] is True and sent[0]["hetspec"] == {"algorithm": "tli", "pipelined": True}
    assert bad.error.startswith("HTTP 400") and bad.tokens == 0


class _FakeLibrary:
    def __init__(self):
        self.prompts = []

    def request(self, prompt_id, prompt):
        from benchmarks.serve_bench import RequestTiming

        self.prompts.append(prompt_id)
        return RequestTiming("library", prompt_id, seconds=1.0, tokens=4, token_ids=[1, 2, 3, 4],
                             stats={"mean_accepted_per_pass": 2.0})


def test_serve_bench_pairs_each_request_with_the_library_and_reports_overhead():
    from benchmarks.serve_bench import RequestTiming, overhead, run_paired

    def server(ids):
        async def send(prompt_id, prompt):
            return RequestTiming("grpc", prompt_id, seconds=1.2, tokens=len(ids), token_ids=list(ids))
        return send

    library = _FakeLibrary()
    timings, library_timings, wall = asyncio.run(run_paired(server([1, 2, 3, 4]), library,
                                                            [("a", "x"), ("b", "y")], total_requests=3))
    assert library.prompts == ["a", "b", "a"] and [t.prompt_id for t in timings] == ["a", "b", "a"]
    cost = overhead(timings, library_timings)
    assert cost["server_over_library"] == pytest.approx(1.2) and cost["library_ms_per_token"] == pytest.approx(250)
    assert cost["identical_tokens"] and cost["library_tokens_per_target_pass"] == 2.0
    timings, library_timings, _ = asyncio.run(run_paired(server([1, 2, 3, 5]), _FakeLibrary(), [("a", "x")], 2))
    assert not overhead(timings, library_timings)["identical_tokens"]


def test_serve_bench_reports_where_a_paired_output_parts_from_the_librarys():
    from benchmarks.serve_bench import RequestTiming, markdown, paired_differences

    class Library:
        def divergence(self, prompt, server_ids, library_ids):
            self.asked = (prompt, server_ids, library_ids)
            return None if server_ids == library_ids else {"position": 2, "server_id": 9, "library_id": 3,
                                                           "target_top2_margin": 0.125, "target_top2_ids": [9, 3]}

    library = Library()
    server = [RequestTiming("grpc", "a", token_ids=[1, 2, 3]), RequestTiming("grpc", "b", token_ids=[1, 2, 9]),
              RequestTiming("grpc", "c", token_ids=[], error="UNAVAILABLE")]
    own = [RequestTiming("library", pid, token_ids=[1, 2, 3]) for pid in "abc"]
    differences = paired_differences(library, [("a", "x"), ("b", "y"), ("c", "z")], server, own)
    assert differences == [{"prompt_id": "b", "position": 2, "server_id": 9, "library_id": 3,
                            "target_top2_margin": 0.125, "target_top2_ids": [9, 3]}]
    assert library.asked == ("y", [1, 2, 9], [1, 2, 3])  # the failed request was not compared
    level = {**summarize_load("grpc", 1, server, 1.0), "differences": differences, "overhead": {
        "library_ms_per_token": 1.0, "server_ms_per_token": 1.1, "server_over_library": 1.1,
        "library_tokens_per_second": 1000.0, "identical_tokens": False, "library_tokens_per_target_pass": 1.5}}
    meta = report.provenance(["--x"], "server", module="benchmarks.serve_bench")
    settings = {"label": "t", "grpc": "g", "http": "h", "model": "m", "requests": 3, "max_new_tokens": 3,
                "task": "humaneval", "options": {}}
    text = markdown({"meta": meta, "settings": settings, "levels": [level]})
    assert ("- grpc b: first differs at token 2 (server 9, library 3); "
            "the target's top-2 logit margin there 0.125") in text


@pytest.mark.real
def test_serve_bench_in_process_runs_the_configs_pair_like_the_library():
    from pathlib import Path

    from benchmarks.serve_bench import InProcess
    from hetspec import Engine

    library = InProcess(Path(__file__).resolve().parent.parent / "deployments/config.small.yaml",
                        RequestOptions(max_new_tokens=8, algorithm="tli", draft_tokens=3))
    assert library.speculation.algorithm == "tli" and library.speculation.draft_tokens == 3
    timing = library.request("p", "def add(a, b):")
    assert timing.tokens == 8 and timing.stats["generated_tokens"] == 8 and timing.first_token_seconds > 0
    reference = Engine(library.engine.target).generate("def add(a, b):", {"max_new_tokens": 8})
    assert timing.token_ids == reference.token_ids
    # a server output parting from the library's at token 3: the target's own (greedy) token there leads its top 2
    parted = timing.token_ids[:3] + [timing.token_ids[3] + 1]
    item = library.divergence("def add(a, b):", parted, timing.token_ids)
    assert item["position"] == 3 and item["server_id"] == parted[3] and item["library_id"] == timing.token_ids[3]
    assert item["target_top2_ids"][0] == timing.token_ids[3] and item["target_top2_margin"] >= 0
    assert library.divergence("def add(a, b):", timing.token_ids, timing.token_ids) is None


@pytest.mark.real
def test_batch_bench_end_to_end_on_the_small_pair(tmp_path):
    """Every method at batch sizes 1 and 2, 6 greedy float32 tokens: table, plot, and batched == batch 1."""
    from benchmarks import batch_bench

    threads = torch.get_num_threads()
    try:
        status = batch_bench.main(["--target", "gemma3-270m", "--drafter", "smollm2-135m", "--dtype", "float32",
                                   "--drafter-quantize", "none", "--batch-sizes", "1", "2", "--max-new-tokens", "6",
                                   "--also-draft-tokens", "2", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert [row["batch_size"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        methods = row["methods"]
        assert set(methods) == {"hf-batched", "hetspec-ar", "hetspec-slem", "hetspec-slem-adaptive",
                                "hetspec-slem-k2", "hetspec-slem-one-at-a-time"}
        assert 0 < methods["hetspec-slem-k2"]["mean_draft_length"] <= 2  # its own draft length, not the default 5
        for name, entry in methods.items():
            assert entry["tokens_per_second"] > 0
            if name != "hf-batched":  # transformers' padded batch may round differently; ours is compared exactly
                assert entry["equal_to_batch_1"] == row["batch_size"], name
    assert (tmp_path / "throughput.png").stat().st_size > 0 and "| 2 |" in (tmp_path / "README.md").read_text()


def test_soak_rss_slope_fits_the_last_minutes_only():
    from benchmarks.soak import rss_slope

    # 40 minutes: RSS climbs 10 MiB/min for 10 minutes (warming up), then flat at 500 MiB
    samples = [{"seconds": 60 * minute, "rss_mib": {"target": 400 + 10 * min(minute, 10)}} for minute in range(41)]
    assert rss_slope(samples, "target", 30 * 60) == pytest.approx(0.0, abs=1e-9)
    assert rss_slope(samples, "target", 45 * 60) > 0  # the whole run still shows the warm-up
    assert rss_slope(samples, "drafter", 30 * 60) is None and rss_slope(samples[:2], "target", 30 * 60) is None


def test_cpu_by_process_groups_the_cpu_time_spent_between_snapshots():
    import os

    from benchmarks import cpu_by_process

    taken = cpu_by_process.snapshot()
    assert taken[os.getpid()][0] == "benchmark clients"
    before = {1: ("ray::TargetWorker", 10.0), 2: ("ray::ServeReplica:hetspec:Coordinator", 1.0), 3: ("raylet", 5.0)}
    after = {1: ("ray::TargetWorker", 16.0), 2: ("ray::ServeReplica:hetspec:Coordinator", 1.5),
             3: ("raylet", 5.01), 4: ("ray::DrafterWorker", 1.0)}  # 4 started meanwhile: all of its time counts
    spent = cpu_by_process.spent(before, after, wall_seconds=4.0)
    cores = spent["cores"]
    assert spent["cpu_seconds"] == 7.51 and abs(spent["busy_share"] - 7.51 / (4.0 * cores)) < 1e-3
    assert list(spent["groups"]) == ["ray::TargetWorker", "ray::DrafterWorker", "ray::ServeReplica:hetspec:Coordinator"]
    assert spent["groups"]["ray::TargetWorker"] == {"cpu_seconds": 6.0, "share": round(6.0 / (4.0 * cores), 4)}


def test_serve_scaling_reports_each_ratio_and_the_longest_gap():
    """The scaling table: served over 1 client, over transformers (both runs and, where measured, beside the
    server at each level) and over speculation off; the latency table names each level's longest stall."""
    from benchmarks.serve_scaling import markdown

    def row(tokens_per_second, gap=None):
        level = {"tokens_per_second": tokens_per_second, "protocol": "grpc", "ttft_ms": {"p50": 1.0, "p99": 2.0},
                 "tpot_ms": {"p50": 3.0, "p99": 4.0}, "tokens_per_target_pass": 1.5}
        return level if gap is None else {**level, "longest_gap_ms": gap}

    meta = {"command": "python -m benchmarks.serve_scaling", "git_commit": "abc1234", "date": "2026-12-06",
            "machine": {"cpu_model": "a CPU", "cpu_cores": 2}}
    result = {"meta": meta, "settings": {"pair": "t <- d", "max_new_tokens": 64, "baseline_commit": None,
                                         "concurrency": [1, 8]},
              "methods": {"hf-batched": {1: row(4.0), 8: row(12.0)}, "hf-batched-after": {1: row(4.0), 8: row(14.0)},
                          "hf-beside": {1: row(5.0), 8: row(10.0)},
                          "served-grpc": {1: row(4.0, gap=300.0), 8: row(11.0, gap=22700.0)},
                          "served-ar-grpc": {1: row(2.0), 8: row(11.0)}}}
    table = markdown(result)
    assert "served / hf-beside |" in table
    assert "| 8 | 12.00 | 14.00 | 10.00 | 11.00 | 11.00 | 2.75x | 0.85x | 1.10x | 1.00x |" in table
    assert "| 8 | served-grpc | 1 / 2 | 3 / 4 | 22700 | 1.50 |" in table
    assert "| 1 | served-ar-grpc | 1 / 2 | 3 / 4 | - | 1.50 |" in table
    del result["methods"]["hf-beside"]
    without = markdown(result)
    assert "hf-beside" not in without and "| 8 | 12.00 | 14.00 | 11.00 | 11.00 | 2.75x | 0.85x | 1.00x |" in without


def test_serve_scaling_pools_the_repeats_of_a_level_and_reports_each_ratio():
    """``--repeats``: a level's rows pool every request over the repeats' summed wall time, and the table adds
    the served over speculation off ratio of each repeat (the two measured back to back)."""
    from dataclasses import asdict

    from benchmarks.serve_bench import RequestTiming
    from benchmarks.serve_scaling import markdown, pooled

    def level(tokens, wall, first_token):
        timing = RequestTiming("grpc", "p", seconds=wall, first_token_seconds=first_token, tokens=tokens,
                               token_latencies=[0.1] * (tokens - 1), longest_gap_seconds=0.5)
        return {"protocol": "grpc", "concurrency": 1, "wall_seconds": wall, "tokens_per_second": tokens / wall,
                "timings": [asdict(timing)]}

    both = pooled([level(64, 16.0, 1.0), level(64, 32.0, 3.0)])
    assert both["tokens_per_second"] == 128 / 48.0 and both["tokens_per_second_by_repeat"] == [4.0, 2.0]
    assert both["output_tokens"] == 128 and both["ttft_ms"]["p50"] == 2000.0 and both["longest_gap_ms"] == 500.0
    assert pooled([level(64, 16.0, 1.0)])["tokens_per_second"] == 4.0  # one repeat: its own row

    def row(by_repeat):
        return {"tokens_per_second": sum(by_repeat) / len(by_repeat), "tokens_per_second_by_repeat": by_repeat,
                "protocol": "grpc", "ttft_ms": {"p50": 1.0, "p99": 2.0}, "tpot_ms": {"p50": 3.0, "p99": 4.0},
                "tokens_per_target_pass": 1.0}

    meta = {"command": "python -m benchmarks.serve_scaling", "git_commit": "abc1234", "date": "2026-12-06",
            "machine": {"cpu_model": "a CPU", "cpu_cores": 2}}
    result = {"meta": meta, "settings": {"pair": "t <- d", "max_new_tokens": 64, "baseline_commit": None,
                                         "concurrency": [4]},
              "methods": {"served-grpc": {4: row([9.0, 8.0, 10.0])}, "served-ar-grpc": {4: row([10.0, 8.0, 8.0])}}}
    assert "| 4 | 9.00 | 8.67 | 1.00x | - | 1.04x | 0.90x, 1.00x, 1.25x |" in markdown(result)


def test_serve_scaling_repeats_each_level_in_abba_order(tmp_path, monkeypatch):
    """``--repeats 2``: each level runs speculation on, off, then off, on (the machine's drift falls on both), into a
    folder a repeat, and the level's row holds each repeat's tokens/s. The server is not started here: the driver's
    order and bookkeeping are what is tested (the served runs are in benchmarks/results/)."""
    import contextlib

    from benchmarks import serve_scaling

    calls = []

    def bench(args, label, concurrencies, protocol, algorithm, folder, extra=(), warmup=True, repeat=0):
        calls.append((label, concurrencies[0], repeat, warmup))
        speed = 10.0 + len(calls)
        protocols = ["grpc", "http"] if protocol == "both" else [protocol]
        return {concurrencies[0]: {name: {"protocol": name, "concurrency": concurrencies[0], "wall_seconds": 64 / speed,
                                          "tokens_per_second": speed, "timings": [
                                              {"protocol": name, "prompt_id": "p", "seconds": 64 / speed,
                                               "first_token_seconds": 1.0, "tokens": 64}]}
                                   for name in protocols}}

    monkeypatch.setattr(serve_scaling, "bench", bench)
    monkeypatch.setattr(serve_scaling, "Served", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(serve_scaling, "plot", lambda result, path: None)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"args": {"target": {"model": "t", "dtype": "float32"},
                                                                  "drafter": {"model": "d"}}}]}))
    assert serve_scaling.main(["--config", str(config), "--concurrency", "1", "4", "--repeats", "2", "--skip", "hf",
                               "baseline", "--out", str(tmp_path / "run")]) == 0
    assert [call[:3] for call in calls] == [("served", 1, 0), ("served-ar", 1, 0), ("served-ar", 1, 1), ("served", 1, 1),
                                            ("served", 4, 0), ("served-ar", 4, 0), ("served-ar", 4, 1), ("served", 4, 1)]
    assert [call[3] for call in calls] == [True, True, False, False, False, False, False, False]  # warm-up: once
    methods = json.loads((tmp_path / "run" / "result.json").read_text())["methods"]
    assert methods["served-grpc"]["4"]["tokens_per_second_by_repeat"] == [15.0, 18.0]
    assert methods["served-ar-grpc"]["4"]["tokens_per_second_by_repeat"] == [16.0, 17.0]
    assert "0.94x, 1.06x" in (tmp_path / "run" / "README.md").read_text()


def test_serve_scaling_runs_a_transformers_level_alone(tmp_path):
    """``--transformers-only`` (a level of ``--hf-beside``, run in a process of its own): transformers' batched
    generate of the config's target at that level, written where the scaling run reads it."""
    from benchmarks.serve_scaling import main

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"args": {"target": {"model": "gemma3-270m",
                                                                              "dtype": "float32"}}}]}))
    assert main(["--transformers-only", "--config", str(config), "--concurrency", "2", "--rounds", "1",
                 "--max-new-tokens", "3", "--out", str(tmp_path / "level")]) == 0
    level = json.loads((tmp_path / "level" / "hf.json").read_text())["2"]
    assert level["output_tokens"] == 2 * 3 and level["tokens_per_second"] > 0


def test_the_served_server_gets_sigint_even_when_the_benchmark_ignores_it():
    """A benchmark run in a script's background has SIGINT ignored; the `serve run` it starts must not inherit
    that, or SIGINT never reaches Serve's shutdown."""
    import signal
    import subprocess
    import sys

    from benchmarks.serve_scaling import in_own_session

    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = in_own_session([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"],
                               stdout=subprocess.PIPE, text=True)
        handler = child.communicate(timeout=60)[0].strip()
        plain = subprocess.run([sys.executable, "-c", "import signal; print(int(signal.getsignal(signal.SIGINT)))"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert handler == "default_int_handler"
    assert plain == str(int(signal.SIG_IGN))  # what a plain child inherits: the case guarded against


def test_serve_scaling_will_not_measure_a_server_it_did_not_start():
    """A port something listens on is found taken (a server left running would answer the health check)."""
    import socket

    from deployments.tools.local_serve import port_free

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_free(port)
    assert port_free(port)


def test_soak_hostile_clients_are_judged_by_the_answers_they_must_get():
    """The hostile kinds of benchmarks/soak.py against a stand-in server: the designed refusals are expected,
    anything else (a keyless request served, a duplicate id failing, a 20 MB body taken) is unexpected."""
    import asyncio
    import json
    import random
    from types import SimpleNamespace

    import httpx

    from benchmarks.soak import Traffic

    def server(request: httpx.Request, keyless_status: int, duplicate_fails: bool) -> httpx.Response:
        if request.headers.get("content-length", "0").isdigit() and int(request.headers["content-length"]) > 4 << 20:
            return httpx.Response(413, json={"error": {"message": "too large"}})
        if not request.headers.get("authorization"):
            return httpx.Response(keyless_status, json={"choices": [{"finish_reason": "length"}]})
        failing = duplicate_fails and request.headers.get("x-request-id") and json.loads(request.content)["prompt"]
        chunk = {"error": {"code": None, "type": "server_error"}} if failing else {"choices": [{"text": "x"}]}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    channel = SimpleNamespace(unary_unary=lambda *args, **kwargs: None, unary_stream=lambda *args, **kwargs: None)

    async def judge(kind: str, keyless_status: int = 401, duplicate_fails: bool = False):
        transport = httpx.MockTransport(lambda request: server(request, keyless_status, duplicate_fails))
        async with httpx.AsyncClient(transport=transport, base_url="http://soak",
                                     headers={"Authorization": "Bearer sk-1"}) as http:
            traffic = Traffic(http, channel, "m", 4, 16, 30.0, storm=3)
            outcome = await traffic.run(kind, random.Random(0))
            return outcome.status, outcome.expected

    assert asyncio.run(judge("keyless_flood")) == ("HTTP 401", True)
    assert asyncio.run(judge("keyless_flood", keyless_status=200)) == ("keyless HTTP [200]", False)
    assert asyncio.run(judge("http_oversized")) == ("HTTP 413", True)
    assert asyncio.run(judge("duplicate_ids")) == ("ok", True)
    assert asyncio.run(judge("duplicate_ids", duplicate_fails=True))[1] is False
    assert asyncio.run(judge("disconnect_storm")) == ("cancelled", True)
